"""What the routes read: one :class:`ServiceState` per application, kept on
``app.state.service``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from opentelemetry.trace import NoOpTracer, Tracer
from prometheus_client import CollectorRegistry

from app.settings import Settings
from app.target import AdminTarget
from kvoffload.instrumentation.prometheus import PrometheusObserver
from kvoffload.runtime.snapshot import EngineSnapshot

__all__ = ["MetricsCache", "ServiceState", "SnapshotCache", "StreamSlots"]


class SnapshotCache:
    """A rendering (JSON body, metrics exposition) of the last snapshot served.

    Pollers often ask again before the engine publishes a new snapshot; they
    then get the same bytes without rendering again. The pair is swapped in
    one assignment, so readers never see a body from another snapshot. Nothing
    here is shared with the engine thread.
    """

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[EngineSnapshot, bytes] | None = None

    def get(self, snap: EngineSnapshot) -> bytes | None:
        entry = self._entry
        if entry is not None and entry[0] is snap:
            return entry[1]
        return None

    def put(self, snap: EngineSnapshot, body: bytes) -> None:
        self._entry = (snap, body)


class MetricsCache:
    """The last ``/metrics`` exposition, reused while it is from the current
    snapshot, or younger than ``max_age`` seconds and from a snapshot with the
    same policy version and engine state.

    Rendering costs about a millisecond of Python, taken from the engine's
    GIL time; the age bound caps that at ``1/max_age`` renderings a second
    however often clients scrape. Discrete changes (a policy switch, a pause)
    are always shown at once; counters may be up to ``max_age`` old, far
    below any scrape interval.
    """

    __slots__ = ("_entry", "max_age")

    def __init__(self, max_age: float = 0.1) -> None:
        self.max_age = max_age
        self._entry: tuple[EngineSnapshot, float, bytes] | None = None

    def get(self, snap: EngineSnapshot) -> bytes | None:
        entry = self._entry
        if entry is None:
            return None
        cached, rendered_at, body = entry
        if cached is snap:
            return body
        same_shape = cached.policy_version == snap.policy_version and cached.state == snap.state
        if same_shape and time.monotonic() - rendered_at < self.max_age:
            return body
        return None

    def put(self, snap: EngineSnapshot, body: bytes) -> None:
        self._entry = (snap, time.monotonic(), body)


class StreamSlots:
    """At most ``limit`` event streams at once. Taken and given back on the
    event loop's thread only, so a plain counter does."""

    __slots__ = ("in_use", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def take(self) -> bool:
        if self.in_use >= self.limit:
            return False
        self.in_use += 1
        return True

    def give_back(self) -> None:
        self.in_use -= 1


@dataclass(slots=True)
class ServiceState:
    settings: Settings
    target: AdminTarget
    registry: CollectorRegistry
    #: the transfer and step histograms /metrics shows (registered on ``registry``)
    prometheus: PrometheusObserver
    #: set when the server begins to shut down: live streams end
    stopping: threading.Event = field(default_factory=threading.Event)
    #: spans for admin actions (a no-op tracer when nothing is exported)
    tracer: Tracer = field(default_factory=NoOpTracer)
    cache_body: SnapshotCache = field(default_factory=SnapshotCache)
    metrics_body: MetricsCache = field(default_factory=MetricsCache)
    streams: StreamSlots = field(init=False)

    def __post_init__(self) -> None:
        self.streams = StreamSlots(self.settings.max_event_streams)
