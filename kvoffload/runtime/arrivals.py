"""When the workload's requests arrive, and the queue of those waiting.

:class:`Arrivals` says when the next request is due (at once when the engine
runs as fast as possible); :class:`WaitingQueue` holds the requests that have
arrived and are not served yet, which the engine hints to its manager. Pacing is
:class:`~kvoffload.runtime.workloads.Pacer`'s: ``speed`` trace seconds per
wall-clock second, anchored at the first request looked at.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from kvoffload.runtime.workloads import Pacer, Request, Workload

__all__ = ["Arrivals", "WaitingQueue"]


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

    def pause(self) -> None:
        """Stop the workload's clock: until :meth:`resume`, no more time
        passes for the requests to come (a paused replay builds no backlog)."""
        self._pacer.pause()

    def resume(self) -> None:
        """Start the clock again where :meth:`pause` stopped it."""
        self._pacer.resume()


class WaitingQueue:
    """Requests that have arrived but are not served yet, oldest first.

    :meth:`admit` moves every request that is due into the queue, up to
    ``capacity`` waiting at once (at full speed every request is due, so the
    queue fills to ``capacity``: the next ``capacity`` requests are known);
    :meth:`take` hands out the oldest. ``on_arrival(request)`` is told of each
    request as it joins, ``on_departure(request)`` as it leaves, in queue
    order: the engine hints the manager with them.
    """

    def __init__(
        self,
        arrivals: Arrivals,
        capacity: int,
        *,
        on_arrival: Callable[[Request], object] | None = None,
        on_departure: Callable[[Request], object] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.arrivals = arrivals
        self.capacity = capacity
        self._waiting: deque[Request] = deque()
        self._on_arrival = on_arrival
        self._on_departure = on_departure

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._waiting)

    def admit(self, *, at_least_one: bool = False, limit: int | None = None) -> int:
        """Move the due requests in (while there is room, at most ``limit``
        of them); how many joined. With ``at_least_one``, an empty queue
        takes the next request even if it is not due yet (a step run by hand
        does not wait for the clock)."""
        joined = 0
        arrivals = self.arrivals
        room = self.capacity - len(self._waiting)
        if limit is not None:
            room = min(room, limit)
        while joined < room and arrivals.peek() is not None:
            if arrivals.due_in() > 0 and not (at_least_one and not self._waiting):
                break
            r = arrivals.take()
            assert r is not None
            self._waiting.append(r)
            joined += 1
            if self._on_arrival is not None:
                self._on_arrival(r)
        return joined

    def due_in(self) -> float:
        """0.0 while a request waits (or none will come), else seconds until
        the next arrival."""
        return 0.0 if self._waiting else self.arrivals.due_in()

    def exhausted(self) -> bool:
        """Nothing waits and the workload has no request left."""
        return not self._waiting and self.arrivals.peek() is None

    def take(self) -> Request | None:
        """Remove and return the oldest waiting request (``None`` if none)."""
        if not self._waiting:
            return None
        r = self._waiting.popleft()
        if self._on_departure is not None:
            self._on_departure(r)
        return r
