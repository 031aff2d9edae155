"""Fixtures for the admin service: a small, fast engine behind the real app.

(No ``__init__.py`` here on purpose: a test package named ``app`` would
shadow the application package. Shared names live in ``api_support``.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
from api_support import ClientFactory, TestClient, small_settings

from app.main import create_app


@pytest.fixture(autouse=True)
def _no_kvoffload_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read KVOFFLOAD_* variables; the developer's must not leak in."""
    for name in list(os.environ):
        if name.startswith(("KVOFFLOAD_", "OTEL_")):
            monkeypatch.delenv(name)


@pytest.fixture
def make_client() -> Iterator[ClientFactory]:
    """``make_client(**settings)`` -> a started client (lifespan run); all are
    closed (engine stopped) at teardown."""
    with contextlib.ExitStack() as stack:

        def make(**overrides: Any) -> TestClient:
            return stack.enter_context(TestClient(create_app(small_settings(**overrides))))

        yield make


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client()
