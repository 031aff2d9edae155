"""A bounded, replayable log of offloading events.

Each record gets a monotonically increasing ``seq`` and a wall-clock
timestamp. The log is a ring: when it is full the oldest record falls off and
is counted as dropped. Consumers either *read* after a cursor (non-destructive;
told how many records they missed if the cursor fell off the ring) or *drain*
(destructive; what vLLM's ``take_events`` does).

Concurrency: one writer (the thread that owns the manager) appends without a
lock; any number of readers and drainers may run in other threads. Readers
copy the ring in one C-level call, drainers serialise among themselves only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from kvoffload.abstract import BlockHash, OffloadingEvent
from kvoffload.errors import ConfigError

__all__ = ["EVENT_KINDS", "EventKind", "EventLog", "EventLogStats", "EventPage", "EventRecord"]

EventKind = Literal["stored", "removed", "policy_switched", "cleared"]
EVENT_KINDS: tuple[EventKind, ...] = ("stored", "removed", "policy_switched", "cleared")

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One entry of the event log."""

    seq: int
    timestamp: float
    kind: EventKind
    block_hashes: tuple[BlockHash, ...] = ()
    block_size: int = 0
    medium: str = ""
    detail: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    def to_offloading_event(self) -> OffloadingEvent | None:
        """The vLLM-shaped event for store/remove records, else ``None``."""
        if self.kind == "stored" or self.kind == "removed":
            return OffloadingEvent(
                block_hashes=list(self.block_hashes),
                block_size=self.block_size,
                medium=self.medium,
                removed=self.kind == "removed",
            )
        return None


@dataclass(frozen=True, slots=True)
class EventPage:
    """Result of :meth:`EventLog.read`."""

    records: tuple[EventRecord, ...]
    #: records after the cursor that are gone (fell off the ring or drained)
    missed: int
    #: cursor for the next read: the seq of the last record returned, or the
    #: cursor passed in (advanced past what was missed) when none was
    next_after_seq: int


@dataclass(frozen=True, slots=True)
class EventLogStats:
    appended: int
    dropped: int
    drained: int
    buffered: int
    capacity: int
    last_seq: int


class EventLog:
    """A ring of :class:`EventRecord` of at most ``capacity`` entries."""

    def __init__(self, capacity: int = 10_000) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"event log capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._ring: deque[EventRecord] = deque(maxlen=capacity)
        self._last_seq = 0
        self._drained = 0
        self._drain_lock = threading.Lock()

    def append(
        self,
        kind: EventKind,
        block_hashes: Sequence[BlockHash] = (),
        block_size: int = 0,
        medium: str = "",
        detail: Mapping[str, str] | None = None,
    ) -> EventRecord:
        """Add a record (writer thread only)."""
        seq = self._last_seq + 1
        record = EventRecord(
            seq,
            time.time(),
            kind,
            tuple(block_hashes),
            block_size,
            medium,
            MappingProxyType(dict(detail)) if detail else _EMPTY,
        )
        self._ring.append(record)
        self._last_seq = seq
        return record

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest record ever appended (0 if none)."""
        return self._last_seq

    def read(self, after_seq: int = 0, limit: int | None = None) -> EventPage:
        """Records with ``seq > after_seq``, oldest first, at most ``limit``."""
        if after_seq < 0:
            raise ConfigError(f"after_seq must be >= 0, got {after_seq}")
        if limit is not None and limit <= 0:
            raise ConfigError(f"limit must be positive, got {limit}")
        records = tuple(self._ring)  # one C-level copy: a consistent view
        if not records:
            last = self._last_seq
            missed = max(0, last - after_seq)
            return EventPage((), missed, max(after_seq, last))
        first = records[0].seq
        missed = max(0, first - after_seq - 1)
        start = max(0, after_seq - first + 1)
        end = len(records) if limit is None else min(len(records), start + limit)
        page = records[start:end]
        next_after = page[-1].seq if page else max(after_seq, first - 1 if missed else after_seq)
        return EventPage(page, missed, next_after)

    def drain(self, limit: int | None = None) -> list[EventRecord]:
        """Remove and return the oldest records (all of them by default)."""
        if limit is not None and limit <= 0:
            raise ConfigError(f"limit must be positive, got {limit}")
        out: list[EventRecord] = []
        popleft = self._ring.popleft
        with self._drain_lock:
            n = len(self._ring) if limit is None else min(limit, len(self._ring))
            for _ in range(n):
                try:
                    out.append(popleft())
                except IndexError:  # pragma: no cover - only another drainer empties it
                    break
            self._drained += len(out)
        return out

    def stats(self) -> EventLogStats:
        buffered = len(self._ring)
        appended = self._last_seq
        drained = self._drained
        return EventLogStats(
            appended=appended,
            dropped=max(0, appended - drained - buffered),
            drained=drained,
            buffered=buffered,
            capacity=self.capacity,
            last_seq=appended,
        )

    def __len__(self) -> int:
        return len(self._ring)
