"""Property-based conformance: Schemathesis fuzzes every operation of the app's
own OpenAPI document and runs all of its checks (no 5xx, status codes,
content types, headers and bodies as documented, invalid input rejected,
valid input accepted, auth enforced)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from api_support import ADMIN_HEADERS, small_settings
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi

from app.main import create_app

# Building the app starts nothing: the engine starts with the lifespan, which
# Schemathesis enters on the first call and leaves in the fixture below.
APP = create_app(small_settings(sse_heartbeat=0.2))
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


@pytest.fixture(scope="module", autouse=True)
def _stop_app() -> Iterator[None]:
    yield
    asgi.shutdown_lifespans()  # stops the engine


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_schema(case: Any) -> None:
    if case.operation.path == "/v1/events/stream":
        # A fuzzed pause may have stopped the flow of records; the stream would
        # then wait for its `limit`. Resume so that records keep coming.
        service = APP.state.service
        if service is not None and service.target.state == "paused":
            service.target.resume().result(10)
    case.call_and_validate(headers=ADMIN_HEADERS, timeout=5)
