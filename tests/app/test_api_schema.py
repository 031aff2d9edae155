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


def test_every_block_count_of_the_cache_view_says_which_block_it_counts() -> None:
    # issue 18: the manager's (offloaded) and the runtime's (GPU) block counts
    # stood side by side in /v1/cache with no unit
    from pydantic import BaseModel

    from app.models import CacheView

    def fields(model: type[BaseModel], where: str) -> list[tuple[str, str]]:
        found = []
        for name, info in model.model_fields.items():
            annotation = info.annotation
            nested = [
                t
                for t in (annotation, *getattr(annotation, "__args__", ()))
                if isinstance(t, type) and issubclass(t, BaseModel)
            ]
            for t in nested:
                found += fields(t, f"{where}.{name}")
            if not nested:
                found.append((f"{where}.{name}", info.description or ""))
        return found

    described = fields(CacheView, "cache")
    about_blocks = [
        (n, d.lower()) for n, d in described if "block" in n.rsplit(".", 1)[1] or "block" in d
    ]
    assert len(about_blocks) > 20
    for name, text in about_blocks:
        if name.endswith("block_size"):
            assert "tokens per" in text, name
        else:
            assert "offloaded block" in text or "gpu block" in text, name


def test_nothing_required_has_a_default() -> None:
    # a default on what must be sent contradicts it: reset's body and its
    # `confirm` had the default false, the one value the route refuses
    document = APP.openapi()
    for name, component in document["components"]["schemas"].items():
        for field in component.get("required", ()):
            assert "default" not in component["properties"][field], (name, field)
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {})
            if body.get("required"):
                for media in body["content"].values():
                    assert "default" not in media["schema"], (method, path)
