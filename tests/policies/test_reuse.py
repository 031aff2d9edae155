"""What is specific to the experimental ``reuse`` policy (not registered)."""

from __future__ import annotations

from kvoffload.abstract import BlockHash
from kvoffload.backend import BlockStatus
from kvoffload.policies.reuse import CLASS_NAMES, ReusePolicy


def _h(i: int) -> BlockHash:
    return BlockHash(f"h{i}".encode())


def _store(p: ReusePolicy, *ids: int) -> None:
    hashes = [_h(i) for i in ids]
    blocks = [BlockStatus() for _ in ids]
    p.insert(hashes, blocks)
    for b in blocks:
        b.ref_cnt = 0


def test_reuse_evicts_a_chains_tail_before_its_head() -> None:
    p = ReusePolicy(8)
    _store(p, 1, 2, 3, 4)
    victims = p.evict(2, ())
    assert victims is not None
    assert [h for h, _, _ in victims] == [_h(4), _h(3)]
    assert _h(1) in p and _h(2) in p


def test_reuse_children_of_an_evicted_block_go_dead_first() -> None:
    p = ReusePolicy(16)
    _store(p, 1, 2, 3)
    _store(p, 7, 8)
    p.touch([_h(7), _h(8)])  # reused: hot
    victims = p.evict(1, {_h(2), _h(3)})
    assert victims is not None and victims[0][0] == _h(1)
    assert p.list_sizes()["dead"] == 1  # 2 lost its parent; 3 still has 2
    victims = p.evict(1, ())
    assert victims is not None and victims[0][0] == _h(2)
    assert victims[0][2] == "dead"


def test_reuse_learns_a_low_probability_for_never_reused_tails() -> None:
    p = ReusePolicy(10_000)
    for r in range(200):
        base = 10 * r
        _store(p, base, base + 1, base + 2)
        p.touch([_h(base), _h(base + 1)])  # heads reused, tail never
    params = p.params()
    assert params["p_new00"] < 0.05
    assert params["p_new10"] > 0.5


def test_reuse_halves_its_counts_every_capacity_stores() -> None:
    p = ReusePolicy(4)
    _store(p, 1, 2)
    assert sum(p._entered) == 2
    _store(p, 3, 4)  # 4 stores: counts halved (ageing)
    assert sum(p._entered) == 2  # 4 entries, halved
    assert len(CLASS_NAMES) == len(p.reuse_probabilities())


def test_reuse_ghost_hit_restores_the_block_as_hot() -> None:
    p = ReusePolicy(2)
    _store(p, 1)
    _store(p, 2)
    assert p.evict(1, ()) is not None
    gone = _h(1) if _h(1) not in p else _h(2)
    p.touch([gone])
    assert p.ghost_hits["ghost"] == 1
    _store(p, int(gone.decode()[1:]))
    assert p.list_sizes()["hot"] == 1


def test_reuse_ordered_items_round_trips_through_seed() -> None:
    p = ReusePolicy(8)
    _store(p, 1, 2, 3)
    q = ReusePolicy(8)
    q.seed(p.ordered_items())
    assert [h for h, _ in q.ordered_items()] == [h for h, _ in p.ordered_items()]
