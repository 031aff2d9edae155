"""The manager protocol, run against every registered eviction policy.

Only what holds whatever the policy is lives here; what is specific to one
policy (which victim it picks, its lists) lives in ``test_lru.py`` /
``test_arc.py``.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import numpy as np
import pytest

from kvoffload import (
    BlockStateError,
    CPUBackend,
    CPULoadStoreSpec,
    OffloadingEvent,
    PolicyOffloadingManager,
)

from .conftest import BLOCK_SIZE, CAPACITY
from .fakes import bh, bhs, ids_of, manager_state, ref_cnt, resident, store


def test_manager_starts_empty_with_backend_capacity(manager: PolicyOffloadingManager) -> None:
    s = manager.stats()
    assert (s.capacity, s.used, s.free, s.pinned, s.in_flight) == (CAPACITY, 0, CAPACITY, 0, 0)
    assert s.block_size == BLOCK_SIZE
    assert s.medium == "CPU"
    assert len(manager) == 0
    assert manager.lookup(bhs(1)) == 0


def test_manager_lookup_counts_the_ready_prefix(manager: PolicyOffloadingManager) -> None:
    store(manager, 1, 2, 3)
    assert manager.prepare_store(bhs(4)) is not None  # in flight, not readable
    assert manager.lookup(bhs(1, 2, 3, 4)) == 3
    assert manager.lookup(bhs(1, 2, 3)) == 3
    assert manager.lookup(bhs(1, 5, 2)) == 1
    assert manager.lookup(bhs(4, 1)) == 0
    assert manager.lookup(bhs(5)) == 0
    assert manager.lookup([]) == 0
    assert manager.lookup(iter(bhs(1, 2))) == 2  # any iterable


def test_manager_lookup_changes_nothing(manager: PolicyOffloadingManager) -> None:
    store(manager, 1, 2, 3)
    manager.prepare_store(bhs(4))
    before = manager_state(manager)
    manager.lookup(bhs(3, 2, 1, 4))
    manager.lookup(bhs(1, 2))
    assert manager_state(manager) == before


def test_manager_prepare_store_allocates_absent_blocks_in_flight(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1)
    out = manager.prepare_store(bhs(1, 2, 3))
    assert out is not None
    assert out.block_hashes_to_store == bhs(2, 3)
    assert out.block_hashes_evicted == []
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert out.store_spec.block_ids.dtype == np.int64
    assert ids_of(out.store_spec) == [1, 2]
    assert ref_cnt(manager, 2) == ref_cnt(manager, 3) == -1
    s = manager.stats()
    assert (s.used, s.free, s.in_flight) == (3, CAPACITY - 3, 2)


def test_manager_prepare_store_of_present_blocks_returns_empty_output(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1, 2)
    out = manager.prepare_store(bhs(2, 1))
    assert out is not None
    assert out.block_hashes_to_store == []
    assert out.block_hashes_evicted == []
    assert ids_of(out.store_spec) == []
    assert manager.take_events() == [OffloadingEvent(bhs(1, 2), BLOCK_SIZE, "CPU", False)]


def test_manager_prepare_store_dedupes_repeated_hashes(manager: PolicyOffloadingManager) -> None:
    out = manager.prepare_store(bhs(1, 2, 1, 2, 3, 3))
    assert out is not None
    assert out.block_hashes_to_store == bhs(1, 2, 3)
    assert len(set(ids_of(out.store_spec))) == 3
    assert manager.stats().free == CAPACITY - 3
    manager.complete_store(bhs(1, 2, 3))
    assert manager.lookup(bhs(1, 2, 3)) == 3


def test_manager_prepare_load_pins_ready_blocks(manager: PolicyOffloadingManager) -> None:
    out = store(manager, 1, 2, 3)
    spec = manager.prepare_load(bhs(3, 1))
    assert isinstance(spec, CPULoadStoreSpec)
    assert spec.block_ids.dtype == np.int64
    assert ids_of(spec) == [ids_of(out.store_spec)[2], ids_of(out.store_spec)[0]]
    manager.prepare_load(bhs(1))
    assert (ref_cnt(manager, 1), ref_cnt(manager, 2), ref_cnt(manager, 3)) == (2, 0, 1)
    assert manager.stats().pinned == 2


@pytest.mark.parametrize("bad", ["absent", "in_flight"])
def test_manager_prepare_load_of_unready_block_raises_and_pins_nothing(
    manager: PolicyOffloadingManager, bad: str
) -> None:
    store(manager, 1, 2)
    if bad == "in_flight":
        manager.prepare_store(bhs(9))
    before = manager_state(manager)
    with pytest.raises(
        BlockStateError, match="in flight" if bad == "in_flight" else "not offloaded"
    ):
        manager.prepare_load(bhs(1, 2, 9))
    assert manager_state(manager) == before
    assert ref_cnt(manager, 1) == ref_cnt(manager, 2) == 0


def test_manager_complete_load_unpins(manager: PolicyOffloadingManager) -> None:
    store(manager, 1, 2)
    manager.prepare_load(bhs(1, 2))
    manager.prepare_load(bhs(1))
    manager.complete_load(bhs(1, 2))
    assert (ref_cnt(manager, 1), ref_cnt(manager, 2)) == (1, 0)
    assert manager.stats().pinned == 1
    manager.complete_load(bhs(1))
    assert manager.stats().pinned == 0


@pytest.mark.parametrize(
    ("hashes", "message"),
    [((1, 3), "not offloaded"), ((1, 2), "not being loaded"), ((1, 4), "not being loaded")],
    ids=["absent", "not-pinned", "in-flight"],
)
def test_manager_complete_load_of_unpinned_block_raises_and_changes_nothing(
    manager: PolicyOffloadingManager, hashes: tuple[int, ...], message: str
) -> None:
    store(manager, 1, 2)
    manager.prepare_store(bhs(4))
    manager.prepare_load(bhs(1))
    before = manager_state(manager)
    with pytest.raises(BlockStateError, match=message):
        manager.complete_load(bhs(*hashes))
    assert manager_state(manager) == before
    assert ref_cnt(manager, 1) == 1


def test_manager_complete_load_of_a_hash_listed_twice_counts_one_pinned_block(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1)
    manager.prepare_load(bhs(1, 1))
    assert (ref_cnt(manager, 1), manager.stats().pinned) == (2, 1)
    manager.complete_load(bhs(1, 1))
    assert (ref_cnt(manager, 1), manager.stats().pinned) == (0, 0)


def test_manager_complete_store_makes_blocks_ready(manager: PolicyOffloadingManager) -> None:
    out = manager.prepare_store(bhs(1, 2))
    assert out is not None
    manager.complete_store(bhs(1, 2))
    assert ref_cnt(manager, 1) == ref_cnt(manager, 2) == 0
    assert manager.lookup(bhs(1, 2)) == 2
    assert manager.stats().in_flight == 0


def test_manager_complete_store_failure_frees_in_flight_and_keeps_ready_blocks(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1)
    manager.prepare_store(bhs(2, 3))
    manager.take_events()
    manager.complete_store(bhs(1, 2, 3), success=False)
    assert manager.lookup(bhs(1)) == 1
    assert ref_cnt(manager, 1) == 0
    assert bh(2) not in manager and bh(3) not in manager
    s = manager.stats()
    assert (s.used, s.free, s.in_flight) == (1, CAPACITY - 1, 0)
    assert s.counters.store_blocks["failed"] == 2
    assert manager.take_events() == []
    # the freed slots are reusable and the hashes can be stored again
    store(manager, 2, 3)
    assert manager.lookup(bhs(1, 2, 3)) == 3


def test_manager_complete_store_failure_keeps_pinned_blocks(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1)
    manager.prepare_load(bhs(1))
    manager.complete_store(bhs(1), success=False)
    assert ref_cnt(manager, 1) == 1
    manager.complete_load(bhs(1))
    assert manager.lookup(bhs(1)) == 1


@pytest.mark.parametrize("success", [True, False])
def test_manager_complete_store_of_unprepared_block_raises_and_changes_nothing(
    manager: PolicyOffloadingManager, success: bool
) -> None:
    manager.prepare_store(bhs(1))
    before = manager_state(manager)
    with pytest.raises(BlockStateError, match="not prepared"):
        manager.complete_store(bhs(1, 7), success=success)
    assert manager_state(manager) == before
    assert ref_cnt(manager, 1) == -1


def test_manager_complete_store_events_one_per_completing_call(
    manager: PolicyOffloadingManager,
) -> None:
    manager.prepare_store(bhs(1, 2, 3))
    manager.complete_store(bhs(1, 2))
    manager.complete_store(bhs(1, 2))  # nothing left to complete: no event
    manager.complete_store(bhs(2, 3, 3))
    assert manager.take_events() == [
        OffloadingEvent(bhs(1, 2), BLOCK_SIZE, "CPU", removed=False),
        OffloadingEvent(bhs(3), BLOCK_SIZE, "CPU", removed=False),
    ]


def test_manager_evicting_prepare_store_emits_one_removed_event(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, *range(CAPACITY))
    manager.take_events()
    out = manager.prepare_store(bhs(100, 101, 102))
    assert out is not None
    assert len(out.block_hashes_evicted) == 3
    events = manager.take_events()
    assert events == [OffloadingEvent(out.block_hashes_evicted, BLOCK_SIZE, "CPU", removed=True)]
    manager.complete_store(out.block_hashes_to_store)
    out2 = manager.prepare_store(bhs(100))  # present: nothing evicted, no event
    assert out2 is not None and out2.block_hashes_evicted == []
    assert manager.take_events() == [
        OffloadingEvent(bhs(100, 101, 102), BLOCK_SIZE, "CPU", removed=False)
    ]


def test_manager_take_events_drains(manager: PolicyOffloadingManager) -> None:
    store(manager, 1)
    assert len(manager.take_events()) == 1
    assert manager.take_events() == []


def test_manager_without_events_records_none(backend: CPUBackend, policy: str) -> None:
    m = PolicyOffloadingManager(backend, policy=policy, enable_events=False)
    store(m, *range(CAPACITY))
    store(m, 100, 101)
    assert m.event_log is None
    assert m.take_events() == []
    assert m.stats().events is None


def test_manager_eviction_skips_pinned_in_flight_and_named_blocks(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1, 2, 3, 4, 5, 6)
    manager.prepare_store(bhs(7, 8))  # in flight
    manager.prepare_load(bhs(1, 3))  # pinned
    manager.take_events()
    # full; evictable and not named: 4, 5 only (2 and 6 are named)
    out = manager.prepare_store(bhs(6, 2, 10, 11))
    assert out is not None
    assert out.block_hashes_to_store == bhs(10, 11)
    assert sorted(out.block_hashes_evicted) == bhs(4, 5)
    for i in (1, 2, 3, 6, 7, 8):
        assert bh(i) in manager
    # nothing evictable is left: 1, 3 pinned, 2, 6 named, 7, 8, 10, 11 in flight
    assert manager.prepare_store(bhs(2, 6, 12)) is None


def test_manager_evicts_pinned_blocks_once_unpinned(manager: PolicyOffloadingManager) -> None:
    store(manager, *range(CAPACITY))
    manager.prepare_load(bhs(*range(CAPACITY)))
    assert manager.prepare_store(bhs(100)) is None
    manager.complete_load(bhs(*range(CAPACITY)))
    out = manager.prepare_store(bhs(100))
    assert out is not None and len(out.block_hashes_evicted) == 1


SCENARIOS = {
    # name: (stored+ready, in flight, pinned, the failing prepare_store)
    "all-in-flight": ((), tuple(range(CAPACITY)), (), (100,)),
    "all-pinned": (tuple(range(CAPACITY)), (), tuple(range(CAPACITY)), (100, 101)),
    "partly-evictable": ((0, 1, 2, 3), (4, 5, 6, 7), (), (100, 101, 102, 103, 104)),
    "evictable-only-if-named": ((0, 1), (2, 3, 4, 5, 6, 7), (), (0, 1, 100)),
    "more-than-capacity": ((), (), (), tuple(range(100, 100 + CAPACITY + 1))),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_manager_prepare_store_without_room_returns_none_and_changes_nothing(
    manager: PolicyOffloadingManager, scenario: str
) -> None:
    ready, in_flight, pinned, request = SCENARIOS[scenario]
    if ready:
        store(manager, *ready)
    if in_flight:
        manager.prepare_store(bhs(*in_flight))
    if pinned:
        manager.prepare_load(bhs(*pinned))
    manager.touch(bhs(*ready[::2]))  # give policies with several lists something to order
    before = manager_state(manager)
    counters = manager.stats().counters
    assert manager.prepare_store(bhs(*request)) is None
    assert manager_state(manager) == before
    new = [h for h in dict.fromkeys(bhs(*request)) if h not in manager]
    assert manager.stats().counters == dataclasses.replace(
        counters,
        rejected_stores=counters.rejected_stores + 1,
        store_blocks=MappingProxyType(
            {
                **counters.store_blocks,
                "rejected_no_room": counters.store_blocks["rejected_no_room"] + len(new),
            }
        ),
    )


def test_manager_touch_makes_the_first_hash_most_recent(
    manager: PolicyOffloadingManager,
) -> None:
    """A prefix's tail is evicted before its head."""
    store(manager, *range(CAPACITY))
    manager.touch(bhs(0, 1, 2, 3))
    out = manager.prepare_store(bhs(*range(100, 100 + CAPACITY)))
    assert out is not None
    assert out.block_hashes_evicted[-4:] == bhs(3, 2, 1, 0)


def test_manager_touch_of_unknown_and_in_flight_blocks_is_harmless(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1)
    manager.prepare_store(bhs(2))
    manager.touch(bhs(2, 99, 1, 2))
    assert ref_cnt(manager, 2) == -1
    assert manager.lookup(bhs(1, 2)) == 1
    manager.complete_store(bhs(2))
    assert manager.lookup(bhs(1, 2)) == 2
    assert bh(99) not in manager


def test_manager_counters_move_exactly(manager: PolicyOffloadingManager) -> None:
    n_stores, k = 3, 2
    for i in range(n_stores):
        store(manager, *range(i * k, i * k + k))
    c = manager.stats().counters
    assert c.store_prepared_blocks == n_stores * k
    assert c.store_blocks["stored"] == n_stores * k
    manager.prepare_store(bhs(0, 1, 50))  # 0, 1 present
    manager.complete_store(bhs(50), success=False)
    manager.lookup(bhs(0, 1, 2, 99))
    manager.lookup(bhs(4))
    manager.touch(bhs(0, 1, 2))
    manager.prepare_load(bhs(0, 1))
    manager.complete_load(bhs(0))
    c = manager.stats().counters
    assert c.store_prepared_blocks == n_stores * k + 1
    assert dict(c.store_blocks) == {
        "stored": n_stores * k,
        "skipped_present": 2,
        "failed": 1,
        "rejected_no_room": 0,
    }
    assert (c.lookups, c.lookup_blocks, c.hit_blocks) == (2, 5, 4)
    assert c.touches == 3
    assert (c.load_blocks, c.load_completed_blocks) == (2, 1)
    assert c.rejected_stores == 0
    assert sum(c.evictions.values()) == 0
    assert manager.stats().hit_ratio == 4 / 5


def test_manager_counts_evictions_by_list(manager: PolicyOffloadingManager) -> None:
    store(manager, *range(CAPACITY))
    store(manager, *range(100, 103))
    evictions = manager.stats().counters.evictions
    assert sum(evictions.values()) == 3
    assert set(evictions) <= set(manager.policy.list_sizes())


def test_manager_stats_snapshot_is_immutable(manager: PolicyOffloadingManager) -> None:
    store(manager, 1, 2)
    s = manager.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.used = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.counters.lookups = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.lists["x"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        s.counters.store_blocks["stored"] = 0  # type: ignore[index]
    frozen = (s.used, dict(s.lists), dict(s.counters.store_blocks), dict(s.counters.evictions))
    store(manager, *range(10, 10 + CAPACITY))
    manager.lookup(bhs(1))
    assert (
        s.used,
        dict(s.lists),
        dict(s.counters.store_blocks),
        dict(s.counters.evictions),
    ) == frozen


def test_manager_stats_used_plus_free_is_capacity(manager: PolicyOffloadingManager) -> None:
    def check() -> None:
        s = manager.stats()
        assert s.used + s.free == s.capacity == CAPACITY
        assert s.used == len(manager)

    check()
    store(manager, 1, 2, 3)
    check()
    manager.prepare_store(bhs(4, 5))
    check()
    manager.complete_store(bhs(4), success=False)
    check()
    store(manager, *range(10, 10 + CAPACITY - 1))  # 5 is still in flight
    check()
    manager.clear()
    check()


def test_manager_clear_keeps_pinned_and_in_flight_blocks(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1, 2, 3, 4)
    manager.prepare_store(bhs(5))
    manager.prepare_load(bhs(2))
    manager.take_events()
    evicted = manager.clear()
    assert manager.event_log is not None
    assert [r.kind for r in manager.event_log.read().records] == ["removed", "cleared"]
    assert sorted(evicted) == bhs(1, 3, 4)
    assert sorted(resident(manager)) == bhs(2, 5)
    assert (ref_cnt(manager, 2), ref_cnt(manager, 5)) == (1, -1)
    s = manager.stats()
    assert (s.used, s.free, s.pinned, s.in_flight) == (2, CAPACITY - 2, 1, 1)
    assert manager.take_events() == [OffloadingEvent(evicted, BLOCK_SIZE, "CPU", removed=True)]
    manager.complete_store(bhs(5))
    manager.complete_load(bhs(2))
    assert manager.lookup(bhs(2, 5)) == 2


def test_manager_len_contains_and_get_block(manager: PolicyOffloadingManager) -> None:
    out = store(manager, 1, 2)
    manager.prepare_store(bhs(3))
    assert len(manager) == 3
    assert bh(3) in manager and bh(4) not in manager
    block = manager.get_block(bh(2))
    assert block is not None and block.is_ready
    assert getattr(block, "block_id", None) == ids_of(out.store_spec)[1]
    assert manager.get_block(bh(4)) is None
    assert manager.policy_name == manager.policy.name


def test_table_bulk_queries_agree_with_get(manager: PolicyOffloadingManager) -> None:
    store(manager, 1, 2, 3)
    manager.prepare_store(bhs(4))
    manager.touch(bhs(2))
    table = manager.table
    hashes = bhs(5, 1, 4, 9, 2, 1)
    assert table.absent(hashes) == [h for h in hashes if table.get(h) is None] == bhs(5, 9)
    assert table.absent(dict.fromkeys(hashes)) == bhs(5, 9)
    assert table.absent(iter(hashes)) == bhs(5, 9) and table.absent([]) == []
    assert table.tags(hashes) == [table.tag_of(h) for h in hashes]
    assert table.lookup(bhs(1, 2, 3, 4)) == 3  # 4's store is in flight


def test_manager_stats_tell_resident_lists_from_ghost_lists(
    manager: PolicyOffloadingManager,
) -> None:
    # fill past capacity so ghost lists (where a policy has them) hold entries
    store(manager, *range(CAPACITY))
    store(manager, *range(CAPACITY, CAPACITY + 4))
    s = manager.stats()
    assert sum(s.resident_lists.values()) == s.used
    assert set(s.resident_lists) | set(s.ghost_lists) == set(s.lists)
    assert not set(s.resident_lists) & set(s.ghost_lists)
    assert set(s.ghost_lists) == set(s.counters.ghost_hits)
