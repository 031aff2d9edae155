"""Immutable views of the engine, published by the engine thread between steps."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from kvoffload.runtime.commands import CommandKind, CommandResult
from kvoffload.stats import ManagerStats

__all__ = ["EngineSnapshot", "EngineState", "RuntimeStats"]

EngineState = Literal["created", "running", "paused", "finished", "stopped"]

_NO_COMMANDS: Mapping[CommandKind, CommandResult] = MappingProxyType({})


def _counter(description: str, default: float = 0) -> Any:
    """A counter field; ``description`` (with its unit) is what the admin API
    documents it with."""
    return field(default=default, metadata={"description": description})


@dataclass(slots=True)
class RuntimeStats:
    """Monotonic counters of the serving loop since start (``reset`` keeps them).

    The one definition of these counters: the engine thread updates its own
    instance in place, each :class:`EngineSnapshot` holds a copy taken when it
    was published (:meth:`copy`), which nobody changes, and the admin API's
    model is derived from these fields and their descriptions. Block counts
    here are of GPU blocks (``gpu_block_size`` tokens each), not offloaded ones.
    """

    steps: int = _counter("engine steps completed")
    requests: int = _counter("requests scheduled and served")
    prompt_tokens: int = _counter(
        "prompt tokens of the requests served (in full GPU blocks); the four outcomes below "
        "add up to it once every load has finished"
    )
    gpu_hit_tokens: int = _counter("prompt tokens found in the GPU prefix cache")
    cpu_hit_tokens: int = _counter(
        "prompt tokens whose KV was loaded from the CPU tier (counted when the load finished)"
    )
    computed_tokens: int = _counter(
        "prompt tokens computed: in neither tier, or their load from the CPU tier failed"
    )
    truncated_tokens: int = _counter(
        "prompt tokens not served (in full GPU blocks, as all of these): past the prefix the "
        "simulated GPU cache prefills at once, half of it (more GPU blocks serve longer prompts "
        "whole)"
    )
    load_jobs: int = _counter("CPU->GPU transfer jobs submitted")
    store_jobs: int = _counter("GPU->CPU transfer jobs submitted")
    failed_jobs: int = _counter("transfer jobs that failed, in either direction")
    loaded_gpu_blocks: int = _counter("GPU blocks copied CPU->GPU by successful load jobs")
    stored_gpu_blocks: int = _counter("GPU blocks copied GPU->CPU by successful store jobs")
    loaded_bytes: int = _counter("bytes copied CPU->GPU by successful load jobs")
    stored_bytes: int = _counter("bytes copied GPU->CPU by successful store jobs")
    verify_failures: int = _counter(
        "loaded GPU blocks whose bytes differed from what was stored (must stay 0)"
    )
    step_seconds_total: float = _counter("wall-clock seconds spent in engine steps", 0.0)
    last_step_seconds: float = _counter("wall-clock seconds of the last engine step", 0.0)

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
    #: tokens per GPU block, the unit of ``runtime``'s block counts (``None``
    #: for a hosted manager: its host owns the GPU side)
    gpu_block_size: int | None = None
    #: the last command of each kind applied so far (what and when)
    commands: Mapping[CommandKind, CommandResult] = field(default_factory=lambda: _NO_COMMANDS)
