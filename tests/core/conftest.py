"""Fixtures of the core tests: one manager per registered policy."""

from __future__ import annotations

import pytest

from kvoffload import CPUBackend, PolicyOffloadingManager
from kvoffload.policies import available_policies

CAPACITY = 8
BLOCK_SIZE = 16


@pytest.fixture(params=available_policies())
def policy(request: pytest.FixtureRequest) -> str:
    """Every registered eviction policy, so a new one is tested automatically."""
    name: str = request.param
    return name


@pytest.fixture
def backend() -> CPUBackend:
    return CPUBackend(block_size=BLOCK_SIZE, num_blocks=CAPACITY)


@pytest.fixture
def manager(backend: CPUBackend, policy: str) -> PolicyOffloadingManager:
    return PolicyOffloadingManager(backend, policy=policy, enable_events=True)
