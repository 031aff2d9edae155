"""Regression tests for the vLLM 0.11.2 offloading defects we must not reproduce
(DESIGN.md section 4, defects 1-6, 9 and 10; 7 and 8 belong to the copy handler).

Each docstring says what vLLM 0.11.2 did and why this test fails on it.
"""

from __future__ import annotations

import pytest

from kvoffload import ARCOffloadingManager, CPUBackend, PolicyOffloadingManager
from kvoffload.policies.arc import ARCPolicy

from .conftest import CAPACITY
from .fakes import bh, bhs, counting_manager, ids_of, manager_state, ref_cnt, resident, store


def test_defect1_arc_touch_of_block_with_store_in_flight_keeps_it_in_t1() -> None:
    """vLLM's ARC ``touch`` pops a T1 block, then for a block that is not ready
    calls ``t1.move_to_end`` on the hash it just popped: ``KeyError``. The
    engine touches right after ``prepare_store``, so every such step crashed.
    Here the touch must not raise and the block must stay in T1 (a store in
    flight is not a second use)."""
    m = ARCOffloadingManager(CPUBackend(16, 4))
    store(m, 1)
    m.prepare_store(bhs(2))
    m.touch(bhs(1, 2))  # would raise KeyError in vLLM
    assert list(m.t1) == bhs(2)
    assert list(m.t2) == bhs(1)
    assert ref_cnt(m, 2) == -1
    m.complete_store(bhs(2))
    assert m.lookup(bhs(1, 2)) == 2


def test_defect2_failed_store_keeps_blocks_that_were_already_ready(
    manager: PolicyOffloadingManager,
) -> None:
    """vLLM's ARC ``complete_store(success=False)`` pops every named block
    from T1/T2 but frees only the ones not ready: a ready block named in the
    call is forgotten without being freed (its data lost, its slot leaked).
    On vLLM ``lookup([1])`` is 0 and used + free < capacity here."""
    store(manager, 1)
    manager.prepare_store(bhs(1, 2))
    manager.complete_store(bhs(1, 2), success=False)
    assert manager.lookup(bhs(1)) == 1
    assert bh(2) not in manager
    s = manager.stats()
    assert (s.used, s.free) == (1, CAPACITY - 1)
    assert s.used + s.free == s.capacity


def test_defect3_prepare_store_without_room_evicts_nothing(
    manager: PolicyOffloadingManager,
) -> None:
    """vLLM's ARC ``prepare_store`` evicts (and frees) victims one at a time and
    returns ``None`` when it runs out part-way: the first victims are gone
    although nothing was stored. With two evictable blocks and three needed,
    vLLM evicts 1 and 2 and then returns ``None``; both must survive."""
    store(manager, *range(1, CAPACITY + 1))
    manager.prepare_load(bhs(*range(3, CAPACITY + 1)))  # only 1 and 2 evictable
    manager.take_events()
    before = manager_state(manager)
    assert manager.prepare_store(bhs(100, 101, 102)) is None
    assert manager_state(manager) == before
    assert manager.lookup(bhs(1, 2)) == 2
    assert manager.take_events() == []


@pytest.mark.parametrize(("target", "evictable_list"), [(4, "t1"), (0, "t2")])
def test_defect4_arc_falls_back_to_the_other_list(target: int, evictable_list: str) -> None:
    """vLLM's ARC picks T1 when ``len(T1) >= target_t1_size`` and otherwise
    scans only T2, returning ``None`` if T2 has nothing evictable even when T1
    has. With T1 = [1] evictable, T2 = [2, 3, 4] pinned and target 4, vLLM
    returns ``None``; the evictable block in the other list must be used
    (checked in both directions)."""
    m = ARCOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3, 4)
    m.touch(bhs(4, 3, 2))  # T1 = [1], T2 = [2, 3, 4]
    pinned = bhs(2, 3, 4) if evictable_list == "t1" else bhs(1)
    m.prepare_load(pinned)
    m.target_t1_size = target
    out = m.prepare_store(bhs(5))
    assert out is not None
    assert out.block_hashes_evicted == ([bh(1)] if evictable_list == "t1" else [bh(2)])
    assert m.stats().counters.evictions == {"t1": 0, "t2": 0, evictable_list: 1}


def test_defect5_blocks_named_in_the_call_are_not_victims(
    manager: PolicyOffloadingManager,
) -> None:
    """vLLM's managers choose victims among all ``ref_cnt == 0`` blocks,
    including ones the same ``prepare_store`` names (already stored, part of
    this request). With 1 the oldest block, ``prepare_store([1, 3])`` evicts 1
    on vLLM (LRU and ARC alike), dropping the request's own prefix. Here the
    named block is the one the policy orders first (1 for LRU and ARC, the
    chain's tail 8 for kvarc)."""
    store(manager, *range(1, CAPACITY + 1))
    first = resident(manager)[0]
    out = manager.prepare_store([first, bh(100)])
    assert out is not None
    assert len(out.block_hashes_evicted) == 1
    assert first not in out.block_hashes_evicted
    assert manager.lookup([first]) == 1
    # with every other block busy, the named one is still not a victim
    manager.complete_store(bhs(100))
    manager.prepare_load([h for h in resident(manager) if h != first])
    assert manager.prepare_store([first, bh(101)]) is None
    assert manager.lookup([first]) == 1


def test_defect6_repeated_hash_in_one_prepare_store_takes_one_slot(
    manager: PolicyOffloadingManager,
) -> None:
    """vLLM's ``prepare_store`` keeps duplicates in ``block_hashes_to_store``:
    ``[1, 1]`` allocates two blocks and the dict keeps only the second, so one
    slot leaks forever (free never returns to capacity). One slot, one id."""
    out = manager.prepare_store(bhs(1, 2, 1))
    assert out is not None
    assert out.block_hashes_to_store == bhs(1, 2)
    assert len(ids_of(out.store_spec)) == 2
    assert manager.stats().free == CAPACITY - 2
    manager.complete_store(bhs(1, 2, 1))
    manager.clear()
    s = manager.stats()
    assert (s.used, s.free) == (0, CAPACITY)


def test_defect9_undrained_events_are_bounded_and_overwrites_counted(
    backend: CPUBackend, policy: str
) -> None:
    """vLLM appends every event to a plain list that only ``take_events``
    empties: with no consumer it grows without bound (memory leak in long
    runs). The log must stay at its capacity and count what it overwrote."""
    m = PolicyOffloadingManager(backend, policy=policy, enable_events=True, event_log_capacity=16)
    for i in range(200):
        store(m, i)
    events = m.stats().events
    assert events is not None
    assert events.buffered == len(m.event_log or ()) == 16
    assert events.appended == events.last_seq > 200  # stores and evictions
    assert events.overwritten == events.appended - 16
    drained = m.take_events()
    assert len(drained) == 16
    assert drained[-1].block_hashes == bhs(199)


#: entries a policy may examine per eviction besides the victims: a constant
#: (a policy with several lists looks at each list's head), far below ``busy``
SMALL = 50


def test_defect10_eviction_does_not_rescan_pinned_blocks(policy: str) -> None:
    """vLLM starts every eviction scan at the LRU end and walks past every
    pinned or in-flight block there: O(pinned) per victim, and ARC restarts
    the scan for each victim of a batch, O(victims * pinned). We count the
    entries a scan examines (a policy looks up each block it considers in
    the manager's busy table): one batch passes the non-evictable head once, and the next
    eviction examines O(1) entries. On vLLM the batch would examine about
    ``victims * busy`` = 25,000 entries and the next eviction ``busy`` again."""
    busy, evictable, victims = 500, 600, 50
    m, refs = counting_manager(busy + evictable, policy)
    m.prepare_store([bh(i) for i in range(busy // 2)])  # in flight, oldest
    pinned = [bh(i) for i in range(busy // 2, busy)]
    m.prepare_store(pinned)
    m.complete_store(pinned)
    m.prepare_load(pinned)
    store(m, *range(busy, busy + evictable))

    refs.reads = 0
    out = m.prepare_store([bh(10_000 + i) for i in range(victims)])
    assert out is not None and len(out.block_hashes_evicted) == victims
    assert refs.reads <= busy + 2 * victims + SMALL

    for j in range(20):
        refs.reads = 0
        out = m.prepare_store([bh(20_000 + j)])
        assert out is not None and len(out.block_hashes_evicted) == 1
        assert refs.reads <= SMALL
    assert all(ref_cnt(m, i) == -1 for i in range(busy // 2))
    assert all(ref_cnt(m, i) == 1 for i in range(busy // 2, busy))


def test_defect10_busy_preferred_arc_list_is_not_rescanned() -> None:
    """When the list ARC prefers holds nothing evictable (here T2, all pinned
    by loads, with the target above len(T1)), vLLM scans all of it before
    falling back to T1, for every eviction: O(pinned) each. After one such
    scan the list must be skipped until one of its blocks can be evicted
    again (a load completes, or a block is promoted into it)."""
    capacity, busy = 1000, 400
    m, refs = counting_manager(capacity, "arc")
    assert isinstance(m.policy, ARCPolicy)
    store(m, *range(busy))
    m.touch(bhs(*range(busy)))  # T2 = 0..399
    m.prepare_load(bhs(*range(busy)))  # all of T2 pinned
    store(m, *range(busy, capacity))  # T1 = 400..999, evictable
    m.policy.target_t1_size = capacity  # len(T1) < target: T2 preferred

    refs.reads = 0
    assert store(m, 10_000).block_hashes_evicted == [bh(busy)]
    assert refs.reads <= busy + SMALL
    for j in range(1, 20):
        refs.reads = 0
        assert store(m, 10_000 + j).block_hashes_evicted == [bh(busy + j)]
        assert refs.reads <= SMALL

    m.complete_load(bhs(7))  # T2 has an evictable block again: preferred
    assert store(m, 20_000).block_hashes_evicted == [bh(7)]
    assert store(m, 20_001).block_hashes_evicted == [bh(busy + 20)]  # T2 all busy again
    m.touch(bhs(busy + 50))  # promoted into T2, evictable: preferred
    assert store(m, 20_002).block_hashes_evicted == [bh(busy + 50)]
    assert store(m, 20_003).block_hashes_evicted == [bh(busy + 21)]


def test_defect10_store_into_a_cache_of_busy_blocks_is_rejected_without_scanning(
    policy: str,
) -> None:
    """With every resident block pinned or in flight, vLLM scans them all
    before answering ``None``, for every ``prepare_store``: O(n) per step
    while the loads or stores last. The answer must come without a scan."""
    capacity = 600
    m, refs = counting_manager(capacity, policy)
    store(m, *range(capacity // 2))
    m.prepare_load(bhs(*range(capacity // 2)))
    m.prepare_store(bhs(*range(capacity // 2, capacity)))
    for j in range(10):
        refs.reads = 0
        assert m.prepare_store(bhs(5_000 + j)) is None
        assert refs.reads <= SMALL
