"""What is specific to the ``kvarc`` policy."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload.policies as policies
from kvoffload import CPUBackend, PolicyOffloadingManager
from kvoffload.abstract import BlockHash
from kvoffload.policies.arc import B1, B2
from kvoffload.policies.kvarc import GHOST_FACTOR, KVARCPolicy
from kvoffload.table import BlockTable


def _h(i: int) -> BlockHash:
    return BlockHash(b"h%d" % i)


def _hs(*ids: int) -> list[BlockHash]:
    return [_h(i) for i in ids]


def _policy(capacity: int) -> KVARCPolicy:
    """A policy on an empty block table of its own."""
    p = KVARCPolicy(capacity, BlockTable())
    p.seed([])
    return p


def _store(p: KVARCPolicy, *ids: int) -> None:
    """insert + complete, as the manager does (in flight, then stored)."""
    hashes = _hs(*ids)
    p.insert(hashes, ids)
    p.table.complete(hashes)


def _evict(p: KVARCPolicy, n: int, protected: tuple[BlockHash, ...] = ()) -> list[BlockHash]:
    out = p.evict(n, set(protected))
    assert out is not None
    return out[0]


def test_kvarc_files_a_chain_tail_first_and_its_tail_cold() -> None:
    p = _policy(8)
    _store(p, 9)
    _store(p, 1, 2, 3)  # 3 is the prompt's tail
    # tail before the older block 9, then the chain from its end to its head
    assert list(p.t1) == _hs(3, 9, 2, 1)
    assert _evict(p, 2) == _hs(3, 9)


def test_kvarc_readmits_ghosts_to_t2_and_adapts_like_arc() -> None:
    p = _policy(4)
    _store(p, 1, 2)
    assert p.target_t1_size == 2.0  # half the capacity: no evidence yet
    assert _evict(p, 2) == _hs(2, 1)
    assert list(p.b1) == _hs(2, 1)
    _store(p, 1, 2, 3)  # 1 and 2 come back: wanted again after eviction
    assert list(p.t2) == _hs(2, 1) and list(p.t1) == _hs(3)
    assert p.ghost_hits == {"b1": 2, "b2": 0} and not p.b1
    assert p.target_t1_size == 4.0  # grew by max(1, |B2|/|B1|) per ghost, capped
    # a ghost of T2 coming back shrinks T1's share
    p.target_t1_size = 0.0
    assert _evict(p, 3) == _hs(3, 2, 1)  # T1 first (above its target), then T2
    assert list(p.b2) == _hs(2, 1)
    p.target_t1_size = 3.0
    _store(p, 2)
    assert p.target_t1_size == 2.0 and p.ghost_hits["b2"] == 1
    assert p.list_sizes() == {"t1": 0, "t2": 1, "b1": 1, "b2": 1}


def test_kvarc_touch_promotes_ready_t1_blocks_in_request_order() -> None:
    p = _policy(8)
    _store(p, 1, 2)
    _store(p, 5)
    p.insert(_hs(6), [6])  # store in flight: touched right away, not a reuse
    p.touch(_hs(1, 2, 5, 6))
    assert list(p.t2) == _hs(5, 2, 1)  # the head ends most recent
    assert list(p.t1) == _hs(6)


def test_kvarc_ghost_lists_are_bounded_and_keep_the_newest() -> None:
    p = _policy(2)
    bound = GHOST_FACTOR * 2
    sizes = []
    for i in range(0, 80, 2):
        _store(p, i, i + 1)
        _evict(p, 2)
        sizes.append(len(p.b1))
    assert max(sizes) <= 2 * bound and min(sizes[-10:]) >= bound
    assert list(p.b1)[-4:] == _hs(77, 76, 79, 78)  # newest last; a chain goes tail first
    p.clear_ghosts()
    assert p.list_sizes()["b1"] == 0


def test_kvarc_runs_under_a_manager_and_switches_live() -> None:
    assert "kvarc" in policies.available_policies()
    m = PolicyOffloadingManager(CPUBackend(16, 6), policy="kvarc")
    for chain in ([1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 2, 3, 8]):
        hashes = _hs(*chain)
        m.touch(hashes)
        hit = m.lookup(hashes)
        out = m.prepare_store(hashes[hit:])
        assert out is not None
        m.complete_store(out.block_hashes_to_store)
    s = m.stats()
    assert s.policy == "kvarc" and set(s.lists) == {"t1", "t2", "b1", "b2"}
    assert "target_t1_size" in s.params and s.used == 6
    assert m.switch_policy("lru") == "kvarc" and len(m) == 6
    m.switch_policy("kvarc")
    assert len(m) == 6 and m.lookup(_hs(1, 2)) == 2


def test_kvarc_touch_after_prepare_store_keeps_the_chain_filing() -> None:
    # vLLM's scheduler touches a request's blocks right after prepare_store:
    # the in-flight blocks must stay filed tail first with the tail cold
    # (they used to move to T1's recent end, undoing both).
    m = PolicyOffloadingManager(CPUBackend(16, 8), policy="kvarc")
    for chain in (_hs(8, 9), _hs(1, 2, 3)):
        out = m.prepare_store(chain)
        assert out is not None
        m.touch(chain)
        m.complete_store(out.block_hashes_to_store)
    kvarc = m.policy
    assert isinstance(kvarc, KVARCPolicy)
    assert list(kvarc.t1) == _hs(3, 9, 8, 2, 1) and not kvarc.t2


def test_kvarc_clear_ghosts_resets_the_adaptation() -> None:
    p = _policy(4)
    _store(p, 1, 2)
    _evict(p, 2)
    _store(p, 1)  # a B1 ghost back: the target grows
    assert p.target_t1_size > 2.0
    p.clear_ghosts()
    assert p.target_t1_size == 2.0 and p.list_sizes()["b1"] == 0


def test_kvarc_block_passed_while_pinned_keeps_its_place() -> None:
    # as in ARC: the eviction passes the pinned cold tail and leaves it where
    # it is, so once released it is the first to go again
    p = _policy(8)
    _store(p, 9)
    _store(p, 1, 2, 3)  # T1: 3 (cold tail), 9, 2, 1
    p.table.pin([_h(3)])
    assert _evict(p, 1) == _hs(9)
    p.table.unpin([_h(3)])
    assert list(p.t1) == _hs(3, 2, 1)
    assert _evict(p, 1) == _hs(3)


def test_kvarc_reports_the_tables_eviction_counts_since_it_started() -> None:
    # the table counts the victims by list (no counting in Python): a policy
    # reports those since it was made, and counts assigned run on from there
    p = _policy(4)
    _store(p, 1, 2, 3)  # T1: 3 (the cold tail), 2, 1
    p.table.touch(_hs(1))  # 1 used again: T2
    assert _evict(p, 2) == _hs(3, 2)  # int(2 + 2 - target 2.0): both from T1
    assert p.evictions == {"t1": 2, "t2": 0}
    p.target_t1_size = 4.0
    _store(p, 5)
    assert _evict(p, 1) == _hs(1)  # T1 is within its target: T2 first
    assert p.evictions == {"t1": 2, "t2": 1}
    later = KVARCPolicy(4, p.table)  # a policy switched to later starts at zero
    assert later.evictions == {"t1": 0, "t2": 0} and p.table.evicted(0) == 2
    p.evictions = {"t1": 10, "t2": 0}
    assert _evict(p, 1) == _hs(5) and p.evictions == {"t1": 11, "t2": 0}


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 12),
    steps=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 30), min_size=1, max_size=6)),
        max_size=40,
    ),
    target=st.floats(0, 12),
)
def test_kvarc_target_moves_by_arcs_formula_exactly(
    capacity: int, steps: list[tuple[bool, list[int]]], target: float
) -> None:
    # the adaptation as the module doc states it, with max() and min(): the
    # policy's written-out arithmetic must give the same float every time
    p = _policy(capacity)
    p.target_t1_size = min(float(capacity), target)
    for store, ids in steps:
        table = p.table
        if not store:
            n = min(ids[0] % 3 + 1, len(table) - table.pinned - table.in_flight)
            if n > 0:
                assert p.evict(n, set()) is not None
            continue
        hashes = list(dict.fromkeys(h for h in _hs(*ids) if h not in table))
        room = capacity - len(table)
        if len(hashes) > room and p.evict(len(hashes) - room, set(hashes)) is None:
            continue
        tags = table.tags(hashes)
        hit1, hit2 = tags.count(B1), tags.count(B2)
        b1, b2 = table.size(B1), table.size(B2)
        step1 = max(1.0, b2 / b1) * hit1 if hit1 else 0.0
        step2 = max(1.0, b1 / b2) * hit2 if hit2 else 0.0
        want = min(float(capacity), max(0.0, p.target_t1_size + step1 - step2))
        _store(p, *(int(h[1:]) for h in hashes))
        assert p.target_t1_size == want and type(p.target_t1_size) is float
