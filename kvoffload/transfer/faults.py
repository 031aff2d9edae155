"""Chaos for any handler: report a seeded fraction of its jobs as failed.

:class:`~kvoffload.transfer.memory.InMemoryOffloadingHandler` injects failures
into its own fake copies; :class:`FaultInjectingHandler` wraps a real one (the
CPU/GPU handler, say), so callers' error paths run against real copies. The
inner handler still runs a doomed job to the end; only its result is turned
into a failure, as when a copy engine reports an error after the fact.
"""

from __future__ import annotations

import random

from kvoffload._checks import is_int, is_number
from kvoffload.errors import ConfigError
from kvoffload.transfer.worker import OffloadingHandler, TransferResult, TransferSpec

__all__ = ["FaultInjectingHandler"]


class FaultInjectingHandler(OffloadingHandler):
    """Wraps ``inner`` and reports a seeded fraction ``rate`` of the jobs it
    accepts as failed (``(job_id, False)``); refusals pass through unchanged.
    A ``rate`` that is not a number in [0, 1] (``True`` included) or a
    ``seed`` that is not an int raises :class:`~kvoffload.errors.ConfigError`."""

    def __init__(self, inner: OffloadingHandler, rate: float, seed: int = 0) -> None:
        # duck-typed, as OffloadingWorker takes handlers (vLLM's own included)
        if not all(callable(getattr(inner, m, None)) for m in ("transfer_async", "get_finished")):
            raise ConfigError(
                "inner must be a handler (transfer_async and get_finished), "
                f"got a {type(inner).__name__}"
            )
        if not (is_number(rate) and 0.0 <= rate <= 1.0):
            raise ConfigError(f"failure rate must be a number in [0, 1], got {rate!r}")
        if not is_int(seed):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self.inner = inner
        self.rate = rate
        self._rng = random.Random(seed)
        self._doomed: set[int] = set()

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        ok = self.inner.transfer_async(job_id, spec)
        if ok and self._rng.random() < self.rate:
            self._doomed.add(job_id)
        return ok

    def get_finished(self) -> list[TransferResult]:
        out = []
        for job_id, ok in self.inner.get_finished():
            if job_id in self._doomed:
                self._doomed.discard(job_id)
                ok = False
            out.append((job_id, ok))
        return out
