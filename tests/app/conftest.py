"""Fixtures for the admin service: a small, fast engine behind the real app.

(No ``__init__.py`` here on purpose: a test package named ``app`` would
shadow the application package.)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.exceptions import StarletteDeprecationWarning

with warnings.catch_warnings():
    # Starlette asks for the httpx2 fork when plain httpx is installed; the
    # client works the same with either.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings

ADMIN = "admin-secret-token"
READ = "read-secret-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
READ_HEADERS = {"Authorization": f"Bearer {READ}"}

#: a tiny engine: few CPU blocks (evictions from the first steps), tiny tensors
SMALL: dict[str, Any] = {
    "capacity": 32,
    "gpu_blocks": 64,
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_size": 8,
    "device": "cpu",
    "command_timeout": 10.0,
    "stop_timeout": 10.0,
}


def small_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {**SMALL, "admin_token": ADMIN, "read_token": READ}
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(autouse=True)
def _no_kvoffload_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read KVOFFLOAD_* variables; the developer's must not leak in."""
    import os

    for name in list(os.environ):
        if name.startswith("KVOFFLOAD_") or name.startswith("OTEL_"):
            monkeypatch.delenv(name)


ClientFactory = Callable[..., TestClient]


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
