"""Immutable views of the engine, published by the engine thread between steps."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

from kvoffload.stats import ManagerStats

EngineState = Literal["created", "running", "paused", "finished", "stopped"]


@dataclass(slots=True)
class RuntimeStats:
    """Monotonic counters of the serving loop since start (``reset`` keeps them).

    The one definition of these counters: the engine thread updates its own
    instance in place, each :class:`EngineSnapshot` holds a copy taken when it
    was published (:meth:`copy`), which nobody changes, and the admin API's
    model is derived from these fields.
    """

    steps: int = 0
    #: requests fully processed
    requests: int = 0
    #: prompt tokens in full blocks, split by where their KV came from
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    computed_tokens: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    failed_jobs: int = 0
    #: GPU-sized blocks copied CPU->GPU / GPU->CPU
    loaded_blocks: int = 0
    stored_blocks: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    #: loaded blocks whose bytes differed from what was stored (must stay 0)
    verify_failures: int = 0
    step_seconds_total: float = 0.0
    last_step_seconds: float = 0.0

    def copy(self) -> RuntimeStats:
        """An independent copy (what a snapshot holds)."""
        return copy.copy(self)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One consistent picture of the engine: every field is from the same instant."""

    state: EngineState
    #: number of the last completed step
    step: int
    #: bumped by every applied policy switch; starts at 1
    policy_version: int
    workload: str
    manager: ManagerStats
    runtime: RuntimeStats
    #: wall-clock time the snapshot was taken (seconds since the epoch)
    timestamp: float
