"""What is specific to the experimental ``reuse`` policy (not registered)."""

from __future__ import annotations

from kvoffload.abstract import BlockHash
from kvoffload.policies.reuse import ReusePolicy


def _h(i: int) -> BlockHash:
    return BlockHash(b"h%d" % i)


def _hs(*ids: int) -> list[BlockHash]:
    return [_h(i) for i in ids]


def _policy(capacity: int) -> tuple[ReusePolicy, dict[BlockHash, int]]:
    """A policy and the busy table a manager would keep for it."""
    p = ReusePolicy(capacity)
    busy: dict[BlockHash, int] = {}
    p.busy = busy
    return p, busy


def _store(p: ReusePolicy, *ids: int) -> list[object]:
    """insert + complete, as the manager does (in flight, then stored)."""
    hashes = _hs(*ids)
    handles = [object() for _ in ids]
    busy = p.busy
    assert isinstance(busy, dict)
    busy.update(dict.fromkeys(hashes, -1))
    p.insert(hashes, handles)
    for h in hashes:
        del busy[h]
    p.stored(hashes)
    return handles


def _victims(p: ReusePolicy, n: int, protected: tuple[BlockHash, ...] = ()) -> list[BlockHash]:
    out = p.evict(n, set(protected))
    assert out is not None
    return [h for h, _ in out]


def test_reuse_evicts_a_chains_tail_before_its_head() -> None:
    p, _ = _policy(8)
    _store(p, 1, 2, 3, 4)
    assert _victims(p, 2) == _hs(4, 3)
    assert _h(1) in p and _h(2) in p


def test_reuse_keeps_often_used_blocks_through_a_scan() -> None:
    p = ReusePolicy(6)
    _store(p, 1, 2)
    p.touch(_hs(1, 2))
    p.touch(_hs(1, 2))  # used three times
    _store(p, 10, 11, 12, 13)
    for i in range(20, 28, 2):  # a scan of blocks seen once: LRU would drop 1, 2
        _victims(p, 2)
        _store(p, i, i + 1)
    assert _h(1) in p and _h(2) in p


def test_reuse_ages_an_old_count_away() -> None:
    p = ReusePolicy(4)
    _store(p, 1)
    p.touch(_hs(1))  # f = 2: outlives about two turnovers, not forever
    _store(p, 2, 3, 4)
    for i in range(100, 130, 3):
        _victims(p, 3)
        _store(p, i, i + 1, i + 2)
    assert _h(1) not in p
    assert p.params()["age"] >= 2


def test_reuse_ghost_count_comes_back_with_the_block() -> None:
    p = ReusePolicy(2)
    _store(p, 1)
    p.touch(_hs(1))
    _store(p, 2)
    assert _victims(p, 1) == _hs(2)  # 1 was used twice
    assert _victims(p, 1) == _hs(1)
    p.touch(_hs(1))  # a use while evicted
    assert p.ghost_hits["ghost"] == 1
    _store(p, 1)
    _store(p, 5)
    assert _victims(p, 1) == _hs(5)
    assert p.list_sizes() == {"new": 0, "reused": 1, "parked": 0, "ghost": 2}


def test_reuse_learns_to_admit_never_reused_tails_last() -> None:
    p = ReusePolicy(10_000)
    for r in range(100):
        base = 10 * r
        _store(p, base, base + 1, base + 2)
        p.touch(_hs(base, base + 1))  # heads reused, the tail never
    params = p.params()
    assert params["reuse_rate_tail"] < 0.05 < 0.5 < params["reuse_rate_body"]
    assert params["tail_admitted"] == 0.0
    _store(p, 5000, 5001, 5002)
    # the never-reused tails, the new one too, go before any other block
    tails = set(_hs(*range(2, 1000, 10), 5002))
    assert set(_victims(p, len(tails))) <= tails


def test_reuse_parks_busy_blocks_until_released() -> None:
    p, busy = _policy(4)
    _store(p, 1, 2, 3)
    busy[_h(3)] = 1  # 3 pinned by a load
    assert _victims(p, 1) == _hs(2)
    assert p.list_sizes()["parked"] == 1
    assert p.evict(3, set()) is None  # 1 and the parked 3 are not enough
    assert _h(1) in p and _h(3) in p
    del busy[_h(3)]
    p.released(_hs(3))
    assert p.list_sizes()["parked"] == 0
    assert _victims(p, 2) == _hs(1, 3)  # 3 was in use most recently


def test_reuse_failed_evict_changes_nothing() -> None:
    p, _ = _policy(8)
    _store(p, 1, 2, 3, 4)
    p.touch(_hs(3))
    before = list(p.ordered_items())
    assert p.evict(3, set(_hs(1, 2))) is None
    assert list(p.ordered_items()) == before
    assert _victims(p, 2, tuple(_hs(1))) == _hs(4, 2)


def test_reuse_ordered_items_round_trips_through_seed() -> None:
    p, _ = _policy(8)
    _store(p, 1, 2, 3)
    p.touch(_hs(2))
    q, _ = _policy(8)
    q.seed(p.ordered_items())
    assert [h for h, _ in q.ordered_items()] == [h for h, _ in p.ordered_items()]
    assert _victims(q, 1) == [next(iter(p.ordered_items()))[0]]
