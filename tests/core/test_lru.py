"""What is specific to the LRU policy and to vLLM's ``LRUOffloadingManager``."""

from __future__ import annotations

from kvoffload import CPUBackend, LRUOffloadingManager, OffloadingEvent
from kvoffload.policies.lru import LRUPolicy
from kvoffload.table import BlockTable

from .fakes import bh, bhs, ids_of, resident, store


def _stored(*ids: int) -> OffloadingEvent:
    return OffloadingEvent(bhs(*ids), 256, "CPU", removed=False)


def _removed(*ids: int) -> OffloadingEvent:
    return OffloadingEvent(bhs(*ids), 256, "CPU", removed=True)


def test_lru_manager_vllm_scenario() -> None:
    """vLLM's canonical LRU walk-through, block ids and events included."""
    m = LRUOffloadingManager(CPUBackend(block_size=256, num_blocks=4), enable_events=True)

    out = m.prepare_store(bhs(1, 2))
    assert out is not None
    assert out.block_hashes_to_store == bhs(1, 2)
    assert out.block_hashes_evicted == []
    assert ids_of(out.store_spec) == [0, 1]
    assert m.lookup(bhs(1)) == 0  # not ready yet
    m.complete_store(bhs(1, 2))
    assert m.lookup(bhs(1, 2)) == 2

    out = m.prepare_store(bhs(2, 3, 4, 5))
    assert out is not None
    assert out.block_hashes_to_store == bhs(3, 4, 5)
    assert ids_of(out.store_spec) == [2, 3, 0]
    assert out.block_hashes_evicted == bhs(1)

    # 2 is evictable, 3, 4, 5 are in flight: no room for two blocks
    assert m.prepare_store(bhs(1, 6)) is None
    m.complete_store(bhs(2, 3, 4, 5))

    assert ids_of(m.prepare_load(bhs(2, 3))) == [1, 2]
    assert m.prepare_store(bhs(6, 7, 8)) is None  # 2 and 3 are pinned
    m.complete_load(bhs(2, 3))

    out = m.prepare_store(bhs(6, 7, 8))
    assert out is not None
    assert out.block_hashes_evicted == bhs(2, 3, 4)
    assert ids_of(out.store_spec) == [3, 2, 1]
    m.complete_store(bhs(6, 7, 8))

    m.touch(bhs(5, 6, 7))  # order is now 8, 7, 6, 5
    out = m.prepare_store(bhs(9))
    assert out is not None
    assert out.block_hashes_evicted == bhs(8)
    assert ids_of(out.store_spec) == [1]

    m.complete_store(bhs(7, 9), success=False)
    assert m.lookup(bhs(7)) == 1  # was ready: stays
    assert m.lookup(bhs(9)) == 0  # was in flight: freed

    assert list(m.take_events()) == [
        _stored(1, 2),
        _removed(1),
        _stored(3, 4, 5),
        _removed(2, 3, 4),
        _stored(6, 7, 8),
        _removed(8),
    ]


def test_lru_manager_accepts_vllm_constructor_arguments() -> None:
    m = LRUOffloadingManager(CPUBackend(block_size=16, num_blocks=2), enable_events=False)
    store(m, 1)
    assert m.take_events() == []
    assert m.policy_name == "lru"
    m2 = LRUOffloadingManager(CPUBackend(16, 2))
    assert m2.event_log is None


def test_lru_evicts_least_recently_used_first() -> None:
    m = LRUOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3, 4)
    m.touch(bhs(1))
    out = m.prepare_store(bhs(5, 6))
    assert out is not None
    assert out.block_hashes_evicted == bhs(2, 3)
    assert resident(m) == bhs(4, 1, 5, 6)


def test_lru_touch_walks_in_reverse() -> None:
    m = LRUOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3, 4)
    m.touch(bhs(1, 2, 3))
    assert resident(m) == bhs(4, 3, 2, 1)


def test_lru_blocks_passed_by_an_eviction_scan_keep_their_places() -> None:
    """A pinned or in-flight block the scan passes stays where it is in
    recency order, as in vLLM's ``OrderedDict`` (later scans skip it until it
    is ready again: defect 10); when it is ready again it goes before the
    blocks that were newer than it."""
    m = LRUOffloadingManager(CPUBackend(16, 6))
    store(m, 1, 2, 3, 4)
    m.prepare_store(bhs(5))
    m.prepare_load(bhs(1))
    m.touch(bhs(5))  # order 1, 2, 3, 4, 5
    store(m, 6)
    out = m.prepare_store(bhs(7))
    assert out is not None and out.block_hashes_evicted == bhs(2)
    assert resident(m) == bhs(1, 3, 4, 5, 6, 7)
    assert m.lookup(bhs(1)) == 1 and bh(1) in m and m.get_block(bh(1)) is not None
    m.complete_store(bhs(7))
    m.complete_load(bhs(1))  # released: the oldest block again
    assert resident(m) == bhs(1, 3, 4, 5, 6, 7)
    m.touch(bhs(3))
    assert store(m, 8).block_hashes_evicted == bhs(1)
    assert resident(m) == bhs(4, 5, 6, 7, 3, 8)


def test_lru_policy_lists_and_seed() -> None:
    p = LRUPolicy(4, BlockTable())
    assert p.list_sizes() == {"lru": 0}
    assert (p.evictions, p.ghost_hits) == ({"lru": 0}, {})
    assert p.touch == p.table.touch  # the table's own method: no Python frame
    m = LRUOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3)
    m.touch(bhs(1))
    p = LRUPolicy(4, m.table)  # what a switch does: a new policy on the same table
    p.seed(m.policy.ordered_items())
    assert [h for h, _ in p.ordered_items()] == bhs(2, 3, 1)
    assert m.table.get(bh(2)) == 1  # the handle: block id 1
    assert p.list_sizes() == {"lru": 3}
    assert p.params() == {}
