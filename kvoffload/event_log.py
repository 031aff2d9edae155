"""A bounded, replayable log of offloading events.

Each record gets a monotonically increasing ``seq`` and a wall-clock
timestamp. The log is a ring: when it is full, a new record pushes out the
oldest, which is counted as *overwritten* (normal when nobody drains: readers
that keep up still saw it). Consumers either *read* after a cursor
(non-destructive; told how many records after their cursor are gone, and
those are counted as *missed*: the sign that a consumer is losing records)
or *drain* (destructive; what vLLM's ``take_events`` does).

Concurrency: one writer (the thread that owns the manager) appends without a
lock while the ring has room, and under the log's lock when it is full (a
drain may be making room at that moment); any number of readers and drainers
may run in other threads. Readers copy the ring in one C-level call; drains,
stats and the missed count take the lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from kvoffload._checks import check_int, is_int
from kvoffload.abstract import BlockHash, OffloadingEvent
from kvoffload.errors import ConfigError

__all__ = [
    "DEFAULT_CAPACITY",
    "EVENT_KINDS",
    "EventKind",
    "EventLog",
    "EventLogStats",
    "EventPage",
    "EventRecord",
]

EventKind = Literal["stored", "removed", "policy_switched", "cleared"]
EVENT_KINDS: tuple[EventKind, ...] = ("stored", "removed", "policy_switched", "cleared")

#: records a log keeps before new ones overwrite the oldest, unless told otherwise
DEFAULT_CAPACITY = 10_000

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
    """Counts of an :class:`EventLog`; at any quiet moment
    ``appended == overwritten + drained + buffered``."""

    #: records ever appended
    appended: int
    #: records pushed out of the full ring by a newer one before any drain
    #: took them (readers may well have read them)
    overwritten: int
    #: records removed by :meth:`EventLog.drain`
    drained: int
    #: records readers asked for (``read`` after a cursor > 0) that were
    #: already gone, overwritten or drained: summed over the answers
    missed: int
    #: records in the ring now
    buffered: int
    capacity: int
    last_seq: int


class EventLog:
    """A ring of :class:`EventRecord` of at most ``capacity`` entries."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if not is_int(capacity) or capacity <= 0:
            raise ConfigError(f"event log capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._ring: deque[EventRecord] = deque(maxlen=capacity)
        self._last_seq = 0
        self._drained = 0
        self._overwritten = 0
        self._missed = 0
        self._lock = threading.Lock()

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
        ring = self._ring
        if len(ring) == self.capacity:
            # Full: this append pushes the oldest out, unless a drain makes
            # room first; decide under the drainers' lock. (Only this thread
            # adds, so a ring with room keeps it until the append below.)
            with self._lock:
                if len(ring) == self.capacity:
                    self._overwritten += 1
                ring.append(record)
                self._last_seq = seq
        else:
            ring.append(record)
            self._last_seq = seq
        return record

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest record ever appended (0 if none)."""
        return self._last_seq

    @property
    def missed(self) -> int:
        """Records readers were told they missed (see :class:`EventLogStats`)."""
        return self._missed

    def read(self, after_seq: int = 0, limit: int | None = None) -> EventPage:
        """Records with ``seq > after_seq``, oldest first, at most ``limit``.

        With a cursor (``after_seq > 0``), the records after it that are gone
        are answered as ``missed`` and added to :attr:`missed`; a read from the
        start (``after_seq=0``) claims no position, so what is gone before the
        oldest record is answered but not counted.

        Raises :class:`~kvoffload.errors.ConfigError` for a cursor past
        :attr:`last_seq` (one kept from another run of the log: following
        the page it would get would skip every record up to it) and for
        arguments that are not ints in range."""
        check_int("after_seq", after_seq, 0)
        if limit is not None and (not is_int(limit) or limit <= 0):
            raise ConfigError(f"limit must be a positive int, got {limit!r}")
        # last_seq first: a record appended after it cannot be taken for gone
        last = self._last_seq
        # + 1: the one writer may have put a record in the ring and not yet
        # counted it in last_seq, and a reader may have been given its seq
        if after_seq > last + 1:
            raise ConfigError(
                f"after_seq {after_seq} is ahead of the log, whose newest seq is {last}"
            )
        records = tuple(self._ring)  # one C-level copy: a consistent view
        if not records:
            missed = max(0, last - after_seq)
            page = EventPage((), missed, max(after_seq, last))
        else:
            first = records[0].seq
            missed = max(0, first - after_seq - 1)
            start = max(0, after_seq - first + 1)
            end = len(records) if limit is None else min(len(records), start + limit)
            chunk = records[start:end]
            next_after = (
                chunk[-1].seq if chunk else max(after_seq, first - 1 if missed else after_seq)
            )
            page = EventPage(chunk, missed, next_after)
        if missed and after_seq:
            with self._lock:
                self._missed += missed
        return page

    def drain(self, limit: int | None = None, through_seq: int | None = None) -> list[EventRecord]:
        """Remove and return the oldest records (all of them by default), at
        most ``limit``, and with ``through_seq`` only those with ``seq <=
        through_seq``.

        A drain is at most once: records it returns are gone, also for a
        caller that never got them. ``through_seq`` makes it safe to repeat:
        read with :meth:`read`, handle the records, then drain through the
        last seq handled; a drain repeated after a lost answer removes
        nothing more (``tests/core/test_event_log.py``).

        Raises :class:`~kvoffload.errors.ConfigError` for a ``through_seq``
        past :attr:`last_seq` (as :meth:`read` does for its cursor) and for
        arguments that are not ints in range."""
        if limit is not None and (not is_int(limit) or limit <= 0):
            raise ConfigError(f"limit must be a positive int, got {limit!r}")
        if through_seq is not None:
            check_int("through_seq", through_seq, 0)
            # + 1: as in read, a record may be in the ring before last_seq counts it
            if through_seq > self._last_seq + 1:
                raise ConfigError(
                    f"through_seq {through_seq} is ahead of the log, whose newest seq is "
                    f"{self._last_seq}"
                )
        out: list[EventRecord] = []
        ring = self._ring
        popleft = ring.popleft
        with self._lock:
            n = len(ring) if limit is None else min(limit, len(ring))
            if through_seq is not None and n:
                # seqs in the ring are consecutive: the first n - k are <= through_seq
                n = max(0, min(n, through_seq - ring[0].seq + 1))
            for _ in range(n):
                try:
                    out.append(popleft())
                except IndexError:  # pragma: no cover - only another drainer empties it
                    break
            self._drained += len(out)
        return out

    def stats(self) -> EventLogStats:
        """The counts now (safe from any thread). Under the lock no drain or
        overwrite runs; an append into free room may, so ``appended`` may be
        ahead of the rest by the records being appended meanwhile."""
        with self._lock:
            buffered = len(self._ring)
            appended = self._last_seq
            return EventLogStats(
                appended=appended,
                overwritten=self._overwritten,
                drained=self._drained,
                missed=self._missed,
                buffered=buffered,
                capacity=self.capacity,
                last_seq=appended,
            )

    def __len__(self) -> int:
        return len(self._ring)
