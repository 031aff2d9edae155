"""The C-level eviction fast paths pick exactly what the block-by-block
scans pick, and a failed eviction changes nothing, on random states."""

from __future__ import annotations

import copy
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.backend import BlockStatus
from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.lru import LRUPolicy, pop_oldest

from .fakes import bh

# a block's state: -1 in flight, 0 evictable, > 0 pinned
states = st.lists(st.sampled_from([-1, 0, 0, 0, 1, 2]), min_size=0, max_size=24)


def _blocks(refs: list[int], base: int = 0) -> OrderedDict[bytes, BlockStatus]:
    od: OrderedDict[bytes, BlockStatus] = OrderedDict()
    for i, r in enumerate(refs):
        b = BlockStatus()
        b.ref_cnt = r
        od[bh(base + i)] = b
    return od


def _order(od: OrderedDict[bytes, BlockStatus]) -> list[tuple[bytes, int]]:
    return [(h, b.ref_cnt) for h, b in od.items()]


def _scan_reference(
    od: OrderedDict[bytes, BlockStatus], n: int, protected: set[bytes]
) -> list[bytes] | None:
    """The oldest ``n`` evictable, unprotected hashes, by a plain scan."""
    picked = [h for h, b in od.items() if b.ref_cnt == 0 and h not in protected][:n]
    return picked if len(picked) == n else None


@settings(max_examples=300, deadline=None)
@given(refs=states, n=st.integers(1, 12), data=st.data())
def test_lru_pop_oldest_matches_a_scan(refs: list[int], n: int, data: st.DataObject) -> None:
    od = _blocks(refs)
    protected = set(data.draw(st.lists(st.sampled_from(list(od) or [bh(999)]), max_size=6)))
    before = _order(od)
    expected = _scan_reference(od, n, protected)
    parked: dict[bytes, BlockStatus] = {}
    victims = pop_oldest(od, n, protected, parked)
    if expected is None:
        assert victims is None
        assert _order(od) == before and not parked  # nothing changed
        return
    assert victims is not None and [h for h, _ in victims] == expected
    # what is left: the entries not taken, in their order, busy ones passed parked
    last = before.index((expected[-1], 0))
    passed_busy = [h for h, r in before[:last] if r != 0]
    assert list(parked) == passed_busy
    gone = set(expected) | set(passed_busy)
    assert _order(od) == [(h, r) for h, r in before if h not in gone]


@settings(max_examples=300, deadline=None)
@given(
    t1=states,
    t2=states,
    target=st.integers(0, 30),
    n=st.integers(1, 12),
    data=st.data(),
)
def test_arc_fast_path_picks_what_the_scan_picks(
    t1: list[int], t2: list[int], target: int, n: int, data: st.DataObject
) -> None:
    p = ARCPolicy(capacity=64)
    p.t1 = _blocks(t1)
    p.t2 = _blocks(t2, base=100)
    p.target_t1_size = float(target)
    everything = [*p.t1, *p.t2]
    protected = set(data.draw(st.lists(st.sampled_from(everything or [bh(999)]), max_size=6)))
    scanned = copy.deepcopy(p)
    first = min(n, len(p.t1), max(0, len(p.t1) - target + 1))
    expected = scanned._scan(n, first, protected)
    got = p.evict(n, protected)
    assert (got is None) == (expected is None)
    if got is not None and expected is not None:
        assert [h for h, _ in got] == [h for h, _ in expected]
    for name in ("t1", "t2"):
        assert _order(getattr(p, name)) == _order(getattr(scanned, name))
    assert (list(p.b1), list(p.b2), p.evictions) == (
        list(scanned.b1),
        list(scanned.b2),
        scanned.evictions,
    )


def test_lru_policy_parks_and_releases_through_the_seam() -> None:
    p = LRUPolicy(capacity=4)
    blocks = [BlockStatus() for _ in range(3)]
    p.insert([bh(1), bh(2), bh(3)], blocks)
    blocks[0].ref_cnt = 1  # pinned
    blocks[1].ref_cnt = 0
    blocks[2].ref_cnt = 0
    victims = p.evict(1, ())
    assert victims is not None and [h for h, _ in victims] == [bh(2)]
    assert p.parked == {bh(1): blocks[0]}
    assert p.get(bh(1)) is blocks[0] and bh(1) in p and len(p) == 2
    assert p.get_many([bh(3), bh(1), bh(9)]) == [blocks[2], blocks[0], None]
    assert p.absent([bh(1), bh(3), bh(9)]) == [bh(9)]
    blocks[0].ref_cnt = 0
    p.released([bh(1)])
    assert not p.parked and list(p.blocks) == [bh(3), bh(1)]
    assert p.get == p.blocks.get  # back to the C lookup
    assert p.remove(bh(1)) is blocks[0] and p.remove(bh(1)) is None
