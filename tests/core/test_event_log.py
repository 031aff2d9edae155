"""The bounded, replayable event log."""

from __future__ import annotations

import itertools
import sys
import threading

import pytest

from kvoffload import ConfigError, EventLog, OffloadingEvent

from .fakes import bhs


def _fill(log: EventLog, n: int) -> None:
    for i in range(n):
        log.append("stored", bhs(i), 16, "CPU")


def _seqs(log: EventLog, after: int = 0) -> list[int]:
    return [r.seq for r in log.read(after).records]


def test_event_log_seq_is_monotonic_from_one() -> None:
    log = EventLog(capacity=10)
    assert log.last_seq == 0
    records = [log.append("stored", bhs(i), 16, "CPU") for i in range(3)]
    records.append(log.append("policy_switched", detail={"from": "lru", "to": "arc"}))
    assert [r.seq for r in records] == [1, 2, 3, 4]
    assert log.last_seq == 4
    assert all(a.timestamp <= b.timestamp for a, b in itertools.pairwise(records))
    assert records[3].detail == {"from": "lru", "to": "arc"}


def test_event_log_record_is_immutable_and_converts_to_vllm_event() -> None:
    log = EventLog()
    stored = log.append("stored", bhs(1, 2), 16, "CPU")
    removed = log.append("removed", bhs(3), 16, "CPU")
    cleared = log.append("cleared", detail={"evicted": "0"})
    assert stored.block_hashes == tuple(bhs(1, 2))
    assert stored.to_offloading_event() == OffloadingEvent(bhs(1, 2), 16, "CPU", removed=False)
    assert removed.to_offloading_event() == OffloadingEvent(bhs(3), 16, "CPU", removed=True)
    assert cleared.to_offloading_event() is None
    with pytest.raises(AttributeError):
        stored.seq = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        cleared.detail["evicted"] = "1"  # type: ignore[index]


def test_event_log_ring_is_bounded_and_counts_overwrites() -> None:
    log = EventLog(capacity=3)
    _fill(log, 5)
    assert len(log) == 3
    assert _seqs(log) == [3, 4, 5]
    s = log.stats()
    assert (s.appended, s.overwritten, s.drained, s.buffered, s.capacity, s.last_seq) == (
        5,
        2,
        0,
        3,
        3,
        5,
    )
    assert [r.seq for r in log.drain(limit=1)] == [3]
    s = log.stats()
    assert (s.appended, s.overwritten, s.drained, s.buffered) == (5, 2, 1, 2)
    assert s.overwritten == s.appended - s.drained - s.buffered
    _fill(log, 4)
    s = log.stats()
    assert (s.appended, s.overwritten, s.drained, s.buffered) == (9, 5, 1, 3)
    assert s.missed == 0  # nobody read: nobody missed anything


def test_event_log_overwrites_are_not_misses_for_a_reader_that_keeps_up() -> None:
    # issue 18: the old "dropped" count grew with every record that left the
    # ring undrained, even when a reader had read them all
    log = EventLog(capacity=4)
    cursor, seen = 0, []
    for _ in range(10):
        _fill(log, 3)
        page = log.read(cursor)
        assert page.missed == 0
        seen += [r.seq for r in page.records]
        cursor = page.next_after_seq
    s = log.stats()
    assert seen == list(range(1, 31))
    assert (s.overwritten, s.missed) == (26, 0)


def test_event_log_counts_what_readers_missed() -> None:
    log = EventLog(capacity=3)
    _fill(log, 2)
    assert log.read(0).missed == 0
    _fill(log, 5)  # seq 1..7, the ring holds 5..7
    assert log.read(2).missed == 2  # 3 and 4 are gone
    assert log.read(4).missed == 0
    assert log.stats().missed == log.missed == 2
    # a read from the start claims no position: told, not counted
    assert log.read(0).missed == 4
    assert log.missed == 2
    # drained records are gone for a reader too
    log.drain(limit=2)
    assert log.read(4).missed == 2  # 5 and 6
    s = log.stats()
    assert (s.missed, s.drained, s.overwritten, s.buffered, s.appended) == (4, 2, 4, 1, 7)


def test_event_log_read_after_cursor() -> None:
    log = EventLog(capacity=10)
    _fill(log, 5)
    page = log.read(after_seq=2)
    assert [r.seq for r in page.records] == [3, 4, 5]
    assert (page.missed, page.next_after_seq) == (0, 5)
    page = log.read(after_seq=5)
    assert (page.records, page.missed, page.next_after_seq) == ((), 0, 5)
    # a cursor from the future (another run of the log): an error, not an
    # empty page whose next_after_seq would skip every record up to it
    with pytest.raises(
        ConfigError, match="after_seq 99 is ahead of the log, whose newest seq is 5"
    ):
        log.read(after_seq=99)
    for bad in (1.5, True, "3"):
        with pytest.raises(ConfigError, match="after_seq must be an int"):
            log.read(after_seq=bad)  # type: ignore[arg-type]
    assert _seqs(log) == [1, 2, 3, 4, 5]  # reading is not destructive


def test_event_log_read_tells_how_many_fell_off() -> None:
    log = EventLog(capacity=3)
    _fill(log, 7)
    page = log.read(after_seq=1)
    assert [r.seq for r in page.records] == [5, 6, 7]
    assert (page.missed, page.next_after_seq) == (3, 7)
    page = log.read(after_seq=4)
    assert page.missed == 0


def test_event_log_read_after_drain_reports_missed() -> None:
    log = EventLog(capacity=5)
    _fill(log, 4)
    log.drain()
    page = log.read(after_seq=1)
    assert (page.records, page.missed, page.next_after_seq) == ((), 3, 4)
    _fill(log, 1)
    page = log.read(after_seq=page.next_after_seq)
    assert [r.seq for r in page.records] == [5] and page.missed == 0


def test_event_log_read_limit_pages_through() -> None:
    log = EventLog(capacity=10)
    _fill(log, 5)
    cursor, seen = 0, []
    while True:
        page = log.read(after_seq=cursor, limit=2)
        if not page.records:
            break
        assert len(page.records) <= 2
        seen += [r.seq for r in page.records]
        cursor = page.next_after_seq
    assert seen == [1, 2, 3, 4, 5]


def test_event_log_drain_removes_oldest_first() -> None:
    log = EventLog(capacity=10)
    _fill(log, 5)
    assert [r.seq for r in log.drain(limit=2)] == [1, 2]
    assert [r.seq for r in log.drain()] == [3, 4, 5]
    assert log.drain() == []
    assert len(log) == 0
    assert log.stats().drained == 5


def test_event_log_drain_through_seq_is_safe_to_repeat() -> None:
    # a drain's answer lost on the way took its records with it; a consumer
    # that reads, handles and then drains through what it handled can repeat
    # the drain and lose nothing
    log = EventLog(capacity=8)
    _fill(log, 12)  # seqs 5..12 kept
    page = log.read(0, limit=3)
    handled = page.records[-1].seq
    assert handled == 7
    assert [r.seq for r in log.drain(through_seq=handled)] == [5, 6, 7]
    assert log.drain(through_seq=handled) == []  # the repeat removes nothing more
    assert log.drain(through_seq=3) == []  # behind the oldest kept
    assert [r.seq for r in log.drain(limit=2, through_seq=12)] == [8, 9]  # the smaller bound
    assert _seqs(log) == [10, 11, 12]
    assert log.stats().drained == 5
    with pytest.raises(ConfigError, match="through_seq 14 is ahead of the log"):
        log.drain(through_seq=14)
    assert [r.seq for r in log.drain(through_seq=12)] == [10, 11, 12]


@pytest.mark.parametrize(
    "call",
    [
        lambda log: EventLog(capacity=0),
        lambda log: log.read(after_seq=-1),
        lambda log: log.read(limit=0),
        lambda log: log.drain(limit=0),
        lambda log: log.drain(through_seq=-1),
        lambda log: log.drain(through_seq=True),
    ],
    ids=["capacity", "after_seq", "read-limit", "drain-limit", "through-negative", "through-bool"],
)
def test_event_log_rejects_bad_arguments(call: object) -> None:
    with pytest.raises(ConfigError):
        call(EventLog())  # type: ignore[operator]


def test_event_log_concurrent_writer_reader_drainer_lose_and_duplicate_nothing() -> None:
    n, capacity = 20_000, 256
    log = EventLog(capacity=capacity)
    done = threading.Event()
    errors: list[BaseException] = []
    drained: list[int] = []
    read_pages = [0]

    def writer() -> None:
        try:
            for i in range(n):
                log.append("stored", bhs(i), 16, "CPU")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            done.set()

    def reader() -> None:
        try:
            cursor = 0
            while not done.is_set() or cursor < log.last_seq:
                page = log.read(after_seq=cursor, limit=64)
                seqs = [r.seq for r in page.records]
                assert seqs == sorted(set(seqs))
                if seqs:
                    assert seqs[0] == cursor + page.missed + 1
                    assert seqs[-1] == page.next_after_seq
                assert page.next_after_seq >= cursor
                cursor = page.next_after_seq
                read_pages[0] += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def drainer() -> None:
        try:
            while not done.is_set():
                batch = [r.seq for r in log.drain(limit=7)]
                assert batch == sorted(batch)
                drained.extend(batch)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often to interleave the three
    try:
        threads = [threading.Thread(target=f) for f in (writer, reader, drainer)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)

    remaining = [r.seq for r in log.read().records]
    stats = log.stats()
    assert stats.appended == n
    assert len(drained) == len(set(drained)) == stats.drained
    assert drained == sorted(drained)
    assert not set(drained) & set(remaining)
    assert set(drained) | set(remaining) <= set(range(1, n + 1))
    assert len(drained) + len(remaining) + stats.overwritten == n
    assert stats.buffered == len(remaining) <= capacity
    assert read_pages[0] > 0


def test_removed_records_say_which_lists_the_victims_left() -> None:
    # issue 18: removed events did not say which list the victims left
    from kvoffload import CPUBackend, PolicyOffloadingManager

    m = PolicyOffloadingManager(CPUBackend(16, 4), policy="arc", enable_events=True)
    for ids in ((1, 2, 3, 4), (5, 6)):
        out = m.prepare_store(bhs(*ids))
        assert out is not None
        m.complete_store(out.block_hashes_to_store)
        m.touch(bhs(1, 2))  # promoted to T2: the next eviction takes T1's blocks
    assert m.event_log is not None
    removed = [r for r in m.event_log.read().records if r.kind == "removed"]
    assert [dict(r.detail) for r in removed] == [{"t1": "2"}]
    m.clear()
    last = [r for r in m.event_log.read().records if r.kind == "removed"][-1]
    assert dict(last.detail) == {"t1": "2", "t2": "2"}
    assert len(last.block_hashes) == 4
