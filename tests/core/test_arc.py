"""What is specific to ARC and to vLLM's ``ARCOffloadingManager`` surface."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvoffload import ARCOffloadingManager, CPUBackend, OffloadingEvent
from kvoffload.policies.arc import B1, B2

from .fakes import bh, bhs, ids_of, store


def _arc(capacity: int = 4, events: bool = False) -> ARCOffloadingManager:
    return ARCOffloadingManager(
        CPUBackend(block_size=16, num_blocks=capacity), enable_events=events
    )


def _keys(od: Mapping[bytes, object]) -> list[bytes]:
    return list(od.keys())


def test_arc_manager_exposes_vllm_attributes() -> None:
    m = _arc(capacity=4)
    assert m.cache_capacity == 4
    assert m.target_t1_size == 0
    # all four: read-only mappings in eviction order (vLLM's are OrderedDicts;
    # reading them works the same: in, len, iteration, [])
    for lst in (m.t1, m.t2, m.b1, m.b2):
        assert isinstance(lst, Mapping) and len(lst) == 0
        assert not hasattr(lst, "__setitem__")
    store(m, 1, 2)
    assert bh(1) in m.t1 and bh(1) not in m.t2
    assert len(m.t1) == 2
    assert _keys(m.t1) == bhs(1, 2)  # LRU first
    m.target_t1_size = 3
    assert m.target_t1_size == 3
    assert m.stats().params["target_t1_size"] == 3.0
    assert m.stats().target_t1_size == 3.0


def test_arc_manager_vllm_style_scenario() -> None:
    m = _arc(capacity=4, events=True)
    out = m.prepare_store(bhs(1, 2))
    assert out is not None and ids_of(out.store_spec) == [0, 1]
    assert m.lookup(bhs(1, 2)) == 0
    m.complete_store(bhs(1, 2))
    assert m.lookup(bhs(1, 2)) == 2

    m.touch(bhs(1))  # second use: T1 -> T2
    assert (_keys(m.t1), _keys(m.t2)) == (bhs(2), bhs(1))

    out = m.prepare_store(bhs(3, 4, 5))
    assert out is not None
    assert out.block_hashes_evicted == bhs(2)  # len(T1)=1 >= target 0: from T1
    assert ids_of(out.store_spec) == [2, 3, 1]
    assert _keys(m.b1) == bhs(2)

    m.touch(bhs(3, 4, 5))  # in flight: not a second use, stays in T1 (reverse walk)
    assert (_keys(m.t1), _keys(m.t2)) == (bhs(5, 4, 3), bhs(1))
    m.complete_store(bhs(3, 4, 5))

    m.touch(bhs(2))  # ghost hit in B1: T1 deserves more room
    assert m.target_t1_size == 1

    out = m.prepare_store(bhs(2))
    assert out is not None
    assert out.block_hashes_evicted == bhs(5)  # len(T1)=3 >= 1
    assert ids_of(out.store_spec) == [1]
    assert bh(2) not in m.b1 and bh(2) in m.t1  # re-stored: no longer a ghost
    assert _keys(m.b1) == bhs(5)
    m.complete_store(bhs(2))

    m.touch(bhs(4, 3, 2))  # all promoted, 4 ends most recent
    assert (_keys(m.t1), _keys(m.t2)) == ([], bhs(1, 2, 3, 4))
    out = m.prepare_store(bhs(6))
    assert out is not None
    assert out.block_hashes_evicted == bhs(1)  # T1 empty (0 < 1): from T2
    assert _keys(m.b2) == bhs(1)
    m.complete_store(bhs(6))

    m.touch(bhs(1))  # ghost hit in B2: |B1|/|B2| = 1
    assert m.target_t1_size == 0

    assert [(e.block_hashes, e.removed) for e in m.take_events()] == [
        (bhs(1, 2), False),
        (bhs(2), True),
        (bhs(3, 4, 5), False),
        (bhs(5), True),
        (bhs(2), False),
        (bhs(1), True),
        (bhs(6), False),
    ]


def test_arc_touch_promotes_ready_t1_block_and_refreshes_t2() -> None:
    m = _arc(capacity=4)
    store(m, 1, 2, 3)
    m.touch(bhs(1, 2))
    assert (_keys(m.t1), _keys(m.t2)) == (bhs(3), bhs(2, 1))
    m.touch(bhs(2))
    assert _keys(m.t2) == bhs(1, 2)
    m.touch(bhs(3))
    assert (_keys(m.t1), _keys(m.t2)) == ([], bhs(1, 2, 3))


def test_arc_in_flight_block_stays_in_t1_on_touch() -> None:
    m = _arc(capacity=4)
    store(m, 1)
    m.prepare_store(bhs(2))
    m.touch(bhs(2, 1))
    assert (_keys(m.t1), _keys(m.t2)) == (bhs(2), bhs(1))
    m.complete_store(bhs(2))
    m.touch(bhs(2))
    assert _keys(m.t2) == bhs(1, 2)


def _ghosts(m: ARCOffloadingManager, ghost_tag: int, *ids: int) -> None:
    """Make ``bhs(*ids)`` ghosts of B1 or B2 (newest last), as evictions
    would, through a list ARC does not use."""
    table, spare = m.table, 3
    hashes = bhs(*ids)
    table.insert(hashes, list(ids), spare)
    table.complete(hashes)
    assert table.evict(spare, len(ids), (), ghost_a=ghost_tag) is not None


def test_arc_b1_hit_raises_target_by_b2_over_b1_capped_at_capacity() -> None:
    m = _arc(capacity=4)
    _ghosts(m, B1, 10, 11)
    _ghosts(m, B2, 20, 21, 22)
    m.touch(bhs(10))
    assert m.target_t1_size == pytest.approx(1.5)  # max(1, 3/2)
    _ghosts(m, B2, 23, 24, 25, 26, 27)
    m.touch(bhs(11))
    assert m.target_t1_size == 4  # 1.5 + 8/2, capped at the capacity
    m.touch(bhs(10))
    assert m.target_t1_size == 4
    assert m.stats().counters.ghost_hits["b1"] == 3


def test_arc_b2_hit_lowers_target_by_b1_over_b2_floored_at_zero() -> None:
    m = _arc(capacity=8)
    m.target_t1_size = 6
    _ghosts(m, B1, 10, 11, 12, 13, 14)
    _ghosts(m, B2, 20, 21)
    m.touch(bhs(20))
    assert m.target_t1_size == pytest.approx(3.5)  # 6 - max(1, 5/2)
    m.table.trim(B1, 0)
    _ghosts(m, B1, 10)
    m.touch(bhs(21))
    assert m.target_t1_size == pytest.approx(2.5)  # - max(1, 1/2)
    _ghosts(m, B1, 11, 12, 13, 14, 15, 16, 17)
    m.touch(bhs(20))
    assert m.target_t1_size == 0  # 2.5 - 8/2, floored
    assert m.stats().counters.ghost_hits["b2"] == 3


@pytest.mark.parametrize(
    ("target", "victim"),
    [(0, 1), (1.5, 1), (2, 1), (2.9, 1), (3, 3), (4, 3)],
)
def test_arc_evicts_from_t1_when_it_reaches_int_target(target: float, victim: int) -> None:
    m = _arc(capacity=4)
    store(m, 1, 2, 3, 4)
    m.touch(bhs(4, 3))  # T1 = [1, 2], T2 = [3, 4]
    m.target_t1_size = target
    out = m.prepare_store(bhs(5))
    assert out is not None
    assert out.block_hashes_evicted == [bh(victim)]
    assert bh(victim) in (m.b1 if victim < 3 else m.b2)


def test_arc_eviction_batch_follows_the_shrinking_t1() -> None:
    m = _arc(capacity=6)
    store(m, 1, 2, 3, 4, 5, 6)
    m.touch(bhs(6, 5, 4))  # T1 = [1, 2, 3], T2 = [4, 5, 6]
    m.target_t1_size = 2
    out = m.prepare_store(bhs(7, 8, 9))
    assert out is not None
    # T1 at 3 >= 2: 1; at 2 >= 2: 2; at 1 < 2: T2's oldest, 4
    assert out.block_hashes_evicted == bhs(1, 2, 4)
    assert (_keys(m.b1), _keys(m.b2)) == (bhs(1, 2), bhs(4))


def test_arc_ghost_lists_are_bounded_by_capacity() -> None:
    m = _arc(capacity=2)
    for i in range(0, 10, 2):
        store(m, i, i + 1)
    assert len(m.b1) == 2
    assert _keys(m.b1) == bhs(6, 7)
    for i in range(20, 30, 2):
        store(m, i, i + 1)
        m.touch(bhs(i, i + 1))
    assert len(m.b1) <= 2 and len(m.b2) <= 2
    assert m.stats().lists == {"t1": 0, "t2": 2, "b1": len(m.b1), "b2": len(m.b2)}


def test_arc_restored_block_leaves_its_ghost_list() -> None:
    m = _arc(capacity=2)
    store(m, 1, 2)
    m.touch(bhs(2))  # T1 = [1], T2 = [2]
    m.target_t1_size = 2
    store(m, 3)  # len(T1) = 1 < 2: evicts 2 from T2
    store(m, 4)  # len(T1) = 2 >= 2: evicts 1 from T1
    assert (_keys(m.b1), _keys(m.b2)) == (bhs(1), bhs(2))
    store(m, 1)
    assert bh(1) in m.t1 and bh(1) not in m.b1
    store(m, 2)
    assert bh(2) in m.t1 and bh(2) not in m.b2
    assert not (set(m.b1) | set(m.b2)) & (set(m.t1) | set(m.t2))


def test_arc_clear_forgets_ghosts_and_target() -> None:
    m = _arc(capacity=2)
    store(m, 1, 2)
    store(m, 3, 4)
    m.touch(bhs(1))
    assert m.target_t1_size == 1 and set(m.b1) == set(bhs(1, 2))
    assert sorted(m.clear()) == bhs(3, 4)
    assert (len(m.t1), len(m.t2), len(m.b1), len(m.b2)) == (0, 0, 0, 0)
    assert m.target_t1_size == 0


def test_arc_lists_unavailable_after_switching_away() -> None:
    m = _arc()
    m.switch_policy("lru")
    with pytest.raises(AttributeError, match="switched to 'lru'"):
        _ = m.t1
    with pytest.raises(AttributeError):
        m.target_t1_size = 1
    assert m.cache_capacity == 4
    m.switch_policy("arc")
    assert len(m.t1) == 0


def test_arc_events_report_ghost_free_removals() -> None:
    m = _arc(capacity=2, events=True)
    store(m, 1, 2)
    store(m, 3)
    assert m.take_events()[-2:] == [
        OffloadingEvent(bhs(1), 16, "CPU", removed=True),
        OffloadingEvent(bhs(3), 16, "CPU", removed=False),
    ]


@pytest.mark.parametrize("value", ["x", None, float("nan"), float("inf"), True])
def test_arc_target_setter_refuses_what_is_not_a_number(value: object) -> None:
    # once accepted, and stats() and the next evicting store raised later
    from kvoffload import ARCOffloadingManager, ConfigError

    m = ARCOffloadingManager(CPUBackend(16, 4))
    with pytest.raises(ConfigError, match="target_t1_size must be a finite number of blocks"):
        m.target_t1_size = value  # type: ignore[assignment]
    # any finite number, as vLLM takes (tests/vllm_compat sets 0..9 on any capacity)
    for ok in (2, 7.5, -1):
        m.target_t1_size = ok
        assert m.target_t1_size == float(ok) and m.stats().target_t1_size == float(ok)
