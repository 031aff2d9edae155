"""What the lifespan builds and the routes read: one :class:`ServiceState` per
application, kept on ``app.state.service``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from app.settings import Settings
from kvoffload.runtime import Engine
from kvoffload.runtime.snapshot import EngineSnapshot

__all__ = ["ServiceState", "SnapshotCache"]


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


@dataclass(slots=True)
class ServiceState:
    settings: Settings
    engine: Engine
    registry: CollectorRegistry
    #: set when the server begins to shut down: live streams end
    stopping: threading.Event = field(default_factory=threading.Event)
    cache_body: SnapshotCache = field(default_factory=SnapshotCache)
    metrics_body: SnapshotCache = field(default_factory=SnapshotCache)
