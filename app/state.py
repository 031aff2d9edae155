"""What the routes read: one :class:`ServiceState` per application, kept on
``app.state.service``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import NoOpTracer, Tracer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from app.models import CacheView
from app.settings import Settings
from app.target import AdminTarget
from kvoffload.event_log import EventLogStats
from kvoffload.instrumentation.prometheus import ApiMetrics, PrometheusObserver
from kvoffload.runtime.snapshot import EngineSnapshot

__all__ = ["MetricsCache", "ServiceState", "SnapshotCache", "StreamSlots", "View"]

#: records an answer renders on the event loop; more go to a worker thread
RENDER_INLINE = 100
#: worker threads rendering large answers at once
RENDER_THREADS = 2


#: what a read answers from: the target's latest snapshot and the event log's
#: counts at the moment of the read (``None`` without an event log)
View = tuple[EngineSnapshot, EventLogStats | None]


def _drained(events: EventLogStats | None) -> int | None:
    return None if events is None else events.drained


class SnapshotCache:
    """A rendering (the ``/v1/cache`` JSON body) of the last view served.

    Pollers often ask again before anything changed; they then get the same
    bytes without rendering again. A view is the same when the snapshot is the
    same object and the event log's counts are equal: a drain or a read from
    another thread changes them without a new snapshot. The pair is swapped in
    one assignment, so readers never see a body from another view. Nothing
    here is shared with the engine thread.
    """

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[View, bytes] | None = None

    def get(self, view: View) -> bytes | None:
        entry = self._entry
        if entry is not None and entry[0][0] is view[0] and entry[0][1] == view[1]:
            return entry[1]
        return None

    def put(self, view: View, body: bytes) -> None:
        self._entry = (view, body)


class MetricsCache:
    """The last ``/metrics`` exposition, reused while it is from the current
    view (see :class:`SnapshotCache`) with no admin API request answered since
    (the API's own counters, :mod:`app.request_metrics`), or younger than
    ``max_age`` seconds and from a snapshot with the same policy version,
    engine state and last commands and an event log drained as far.

    Rendering costs about a millisecond of Python, taken from the engine's
    GIL time; the age bound caps that at ``1/max_age`` renderings a second
    however often clients scrape. Discrete changes (a policy switch, a pause,
    a reset, a drain) are always shown at once; counters may be up to ``max_age`` old,
    far below any scrape interval.
    """

    __slots__ = ("_entry", "max_age")

    def __init__(self, max_age: float = 0.1) -> None:
        self.max_age = max_age
        self._entry: tuple[View, int, float, bytes] | None = None

    def get(self, view: View, answered: int) -> bytes | None:
        """The body to reuse for ``view`` after ``answered`` API requests, or None."""
        entry = self._entry
        if entry is None:
            return None
        (cached, events), cached_answered, rendered_at, body = entry
        snap, now = view
        if cached is snap and events == now and cached_answered == answered:
            return body
        same_shape = (
            cached.policy_version == snap.policy_version
            and cached.state == snap.state
            and cached.commands == snap.commands  # a reset changes neither above
            and _drained(events) == _drained(now)
        )
        if same_shape and time.monotonic() - rendered_at < self.max_age:
            return body
        return None

    def put(self, view: View, body: bytes, answered: int) -> None:
        self._entry = (view, answered, time.monotonic(), body)


#: the expositions ``/metrics`` serves: name -> (content type, renderer).
#: Only OpenMetrics has exemplars (the trace of a step in a histogram bucket).
METRICS_FORMATS: dict[str, tuple[str, Callable[[CollectorRegistry], bytes]]] = {
    "text": (CONTENT_TYPE_LATEST, generate_latest),
    "openmetrics": (openmetrics.CONTENT_TYPE_LATEST, openmetrics.generate_latest),
}


def metrics_format(accept: str | None) -> str:
    """``"openmetrics"`` when ``accept`` (an Accept header) takes OpenMetrics
    at least as gladly as the text format (Prometheus asks for it first),
    else ``"text"``, the default."""
    best = {"openmetrics": 0.0, "text": 0.0}
    for item in (accept or "").split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        kind = {"application/openmetrics-text": "openmetrics", "text/plain": "text"}.get(
            media.lower(), "text" if media in ("*/*", "text/*") else None
        )
        if kind is not None:
            best[kind] = max(best[kind], q)
    return (
        "openmetrics" if best["openmetrics"] > 0 and best["openmetrics"] >= best["text"] else "text"
    )


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
    #: per exposition format (:data:`METRICS_FORMATS`)
    metrics_bodies: dict[str, MetricsCache] = field(
        default_factory=lambda: {name: MetricsCache() for name in METRICS_FORMATS}
    )
    streams: StreamSlots = field(init=False)
    #: the admin API's own request counts (registered on ``registry``)
    api_metrics: ApiMetrics = field(init=False)
    #: large answers rendered at once in worker threads (see :meth:`render`)
    renders: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(RENDER_THREADS))

    def __post_init__(self) -> None:
        self.streams = StreamSlots(self.settings.max_event_streams)
        self.api_metrics = ApiMetrics(registry=self.registry)

    async def render(self, build: Callable[[], bytes], records: int) -> bytes:
        """``build()``, inline for a few records, else in a worker thread, at
        most :data:`RENDER_THREADS` at once. A page of 10,000 events takes a
        tenth of a second or more of Python: run on the event loop, every
        other request (``/livez`` too) would wait for it, and many readers at
        once held the loop for seconds. In a thread the loop gets the GIL
        between its slices, and a slow reader waits for a render slot instead
        of taking the threads commands need."""
        if records <= RENDER_INLINE:
            return build()
        async with self.renders:
            return await asyncio.to_thread(build)

    def view(self) -> View:
        """The target's latest snapshot and the event log's counts now: the
        log is drained and read from other threads than the one publishing
        snapshots, so the snapshot's copy of its counts may be stale."""
        log = self.target.event_log
        return self.target.snapshot(), log.stats() if log is not None else None

    def cache_json(self) -> bytes:
        """The ``/v1/cache`` body of the current view (see :class:`SnapshotCache`)."""
        view = self.view()
        body = self.cache_body.get(view)
        if body is None:
            body = CacheView.from_view(*view).model_dump_json().encode()
            self.cache_body.put(view, body)
        return body

    def metrics_text(self, fmt: str = "text") -> bytes:
        """The ``/metrics`` exposition of the current view in ``fmt`` (a key
        of :data:`METRICS_FORMATS`; see :class:`MetricsCache`).

        Rendered inline: collection holds the GIL either way, a threadpool
        hop would only add a context switch."""
        view, answered = self.view(), self.api_metrics.answered
        cache = self.metrics_bodies[fmt]
        body = cache.get(view, answered)
        if body is None:
            body = METRICS_FORMATS[fmt][1](self.registry)
            cache.put(view, body, answered)
        return body
