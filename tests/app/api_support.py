"""What the admin-service tests share: tokens, a small engine, the test client.

A module of its own (not ``conftest``): other test directories have a
``conftest`` too, and ``from conftest import ...`` would depend on which was
imported first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from starlette.exceptions import StarletteDeprecationWarning

with warnings.catch_warnings():
    # Starlette asks for the httpx2 fork when plain httpx is installed; the
    # client works the same with either.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

from app.settings import Settings

__all__ = [
    "ADMIN",
    "ADMIN_HEADERS",
    "READ",
    "READ_HEADERS",
    "SMALL",
    "ClientFactory",
    "TestClient",
    "small_settings",
]

ADMIN = "admin-secret-token"
READ = "read-secret-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
READ_HEADERS = {"Authorization": f"Bearer {READ}"}

#: a tiny engine: few CPU blocks (evictions from the first steps), tiny tensors
SMALL: dict[str, Any] = {
    "num_cpu_blocks": 32,
    "gpu_blocks": 64,
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_size": 8,
    "device": "cpu",
    "command_timeout": 10.0,
    "stop_timeout": 10.0,
    "speed": 0.0,  # full speed: the tests want traffic, not real time
}

ClientFactory = Callable[..., TestClient]


def small_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {**SMALL, "admin_token": ADMIN, "read_token": READ}
    values.update(overrides)
    return Settings(**values)
