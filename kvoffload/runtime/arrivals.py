"""When the workload's requests arrive: the next one, and how long until it is due.

The engine asks between steps; a request is taken once it is due (at once
when the engine runs as fast as possible). Pacing is
:class:`~kvoffload.runtime.workloads.Pacer`'s: ``speed`` trace seconds per
wall-clock second, anchored at the first request looked at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from kvoffload.runtime.workloads import Pacer, Request, Workload

__all__ = ["Arrivals"]


class Arrivals:
    """The requests of ``workload`` in order, each due when ``speed`` says."""

    def __init__(
        self,
        workload: Workload,
        speed: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._requests: Iterator[Request] = iter(workload)
        self._pacer = Pacer(speed, clock=clock)
        self._next: Request | None = None
        self._exhausted = False

    def peek(self) -> Request | None:
        """The next request, due or not; ``None`` once the workload is over."""
        if self._next is None and not self._exhausted:
            self._next = next(self._requests, None)
            self._exhausted = self._next is None
        return self._next

    def due_in(self) -> float:
        """Seconds until the next request is due (0.0 if it is, or if none is left)."""
        r = self.peek()
        return 0.0 if r is None else self._pacer.delay(r)

    def take(self) -> Request | None:
        """Remove and return the next request (due or not)."""
        r = self.peek()
        self._next = None
        return r
