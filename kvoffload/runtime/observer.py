"""Hooks the engine calls so that telemetry stays out of the runtime.

:mod:`kvoffload.instrumentation` implements :class:`EngineObserver` for
Prometheus and OpenTelemetry; the runtime itself imports neither. Observers
are called on the engine thread (a :class:`~kvoffload.runtime.HostedManager`
calls ``command_applied`` only, on the thread that applied the command) and
must be cheap and never raise (the caller logs and drops an observer's
exception rather than stopping).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from kvoffload.runtime.commands import CommandResult

__all__ = ["Direction", "EngineObserver", "RequestRecord", "TransferRecord", "notify"]

Direction = Literal["store", "load"]

logger = logging.getLogger(__name__)


def notify(hook: Callable[..., object], *args: object) -> None:
    """Call an observer's hook; its exception is logged and dropped."""
    try:
        hook(*args)
    except Exception:
        logger.exception("engine observer %r failed; ignoring", hook)


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """A finished transfer job."""

    job_id: int
    #: "store" = GPU->CPU, "load" = CPU->GPU
    direction: Direction
    #: GPU-sized blocks copied
    blocks: int
    nbytes: int
    submitted_ns: int
    finished_ns: int
    ok: bool


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A request the engine finished, with where its prompt's KV came from.

    Reported once all of it is known: a request whose prefix is loaded from
    the CPU tier is reported when its load job finishes, and a failed load's
    tokens count as computed (they were), never as CPU hits. Tokens are
    counted in full GPU blocks; ``prompt_tokens`` is the sum of the four
    outcomes.
    """

    request_id: int
    #: the step that served it
    step: int
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    #: ``time.perf_counter_ns()`` when it was scheduled and when it was finished
    #: (0 when unknown)
    started_ns: int = 0
    finished_ns: int = 0
    #: tokens past the prefix the simulated GPU cache can prefill at once
    #: (half of it): not served
    truncated_tokens: int = 0


class EngineObserver:
    """Base observer: every hook does nothing. Override what you need."""

    def step_started(self, step: int, start_ns: int) -> None:
        """Step ``step`` (1-based) begins."""

    def step_finished(self, step: int, start_ns: int, end_ns: int, requests: int) -> None:
        """Step ``step`` ended after processing ``requests`` requests."""

    def transfer_finished(self, record: TransferRecord) -> None:
        """A transfer job completed (successfully or not)."""

    def request_finished(self, record: RequestRecord) -> None:
        """A request's prompt has been served."""

    def blocks_evicted(self, step: int, count: int, policy: str, lists: Mapping[str, int]) -> None:
        """``count`` offloaded blocks were evicted during ``step``, by ``policy``:
        ``lists`` says how many left each of its resident lists."""

    def command_applied(self, result: CommandResult) -> None:
        """A queued command took effect."""

    def close(self) -> None:
        """The engine stopped; flush anything buffered."""
