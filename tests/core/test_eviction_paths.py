"""Batched eviction (``RecencyList.take``) picks exactly what a
block-by-block scan picks, parks the pinned blocks it passes (in-flight ones
move to the recent end), and a failed
eviction changes nothing; on random states, for LRU and ARC."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.lru import LRUPolicy
from kvoffload.policies.recency import RecencyList, Taken

from .fakes import bh

# a block's state: -1 in flight, 0 evictable, > 0 pinned
states = st.lists(st.sampled_from([-1, 0, 0, 0, 1, 2]), min_size=0, max_size=24)

State = list[tuple[bytes, int]]


def _fill(lst: RecencyList, refs: list[int], busy: dict[bytes, int], base: int = 0) -> None:
    """Blocks ``bh(base + i)`` with handle ``base + i``, busy as ``refs`` says."""
    for i, r in enumerate(refs):
        lst.order[bh(base + i)] = base + i
        if r:
            busy[bh(base + i)] = r


def _state(lst: RecencyList, busy: dict[bytes, int]) -> State:
    return [(h, busy.get(h, 0)) for h in lst]


def _pick(state: State, n: int, protected: set[bytes]) -> list[bytes]:
    """Up to ``n`` oldest evictable, unprotected hashes, by a plain scan."""
    return [h for h, r in state if r == 0 and h not in protected][:n]


def _after(state: State, victims: list[bytes], exhausted: bool = False) -> State:
    """The list after evicting ``victims``. The busy entries the scan passed
    (older than the last victim, or all of them if the scan reached the end)
    leave their place: in-flight ones to the recent end of the order, pinned
    ones to the parked table (listed last); the rest keep their order."""
    scanned = state if exhausted else state[: state.index((victims[-1], 0))] if victims else []
    in_flight = [e for e in scanned if e[1] < 0]
    pinned = [e for e in scanned if e[1] > 0]
    moved = in_flight + pinned
    return [e for e in state if e[0] not in victims and e not in moved] + moved


def _protected(data: st.DataObject, hashes: list[bytes]) -> set[bytes]:
    return set(data.draw(st.lists(st.sampled_from(hashes or [bh(999)]), max_size=6)))


@settings(max_examples=300, deadline=None)
@given(refs=states, n=st.integers(1, 12), data=st.data())
def test_lru_eviction_matches_a_scan(refs: list[int], n: int, data: st.DataObject) -> None:
    p = LRUPolicy(capacity=64)
    busy: dict[bytes, int] = {}
    p.busy = busy
    _fill(p.blocks, refs, busy)
    before = _state(p.blocks, busy)
    protected = _protected(data, [h for h, _ in before])
    expected = _pick(before, n, protected)
    victims = p.evict(n, protected)
    if len(expected) < n:
        assert victims is None
        assert _state(p.blocks, busy) == before and not p.blocks.parked  # nothing changed
        return
    assert victims is not None and [h for h, _ in victims] == expected
    assert _state(p.blocks, busy) == _after(before, expected)
    assert p.evictions == {"lru": n}


def _arc_pick(
    t1: State, t2: State, target: int, n: int, protected: set[bytes]
) -> tuple[list[bytes], list[bytes], bool, bool] | None:
    """ARC's choice spelled out: T1 while it is at or above the target, then
    T2, then T1 again; and whether each list was scanned to its end."""
    ev1 = _pick(t1, len(t1), protected)
    ev2 = _pick(t2, len(t2), protected)
    first = min(n, max(0, len(t1) - target + 1))
    v1 = ev1[:first]
    done1 = len(v1) < first
    v2 = ev2[: n - len(v1)]
    done2 = len(v2) < n - len(v1)
    if len(v1) + len(v2) < n and not done1:
        v1 = ev1[: n - len(v2)]
    return (v1, v2, done1, done2) if len(v1) + len(v2) == n else None


@settings(max_examples=300, deadline=None)
@given(t1=states, t2=states, target=st.integers(0, 30), n=st.integers(1, 12), data=st.data())
def test_arc_eviction_matches_its_definition(
    t1: list[int], t2: list[int], target: int, n: int, data: st.DataObject
) -> None:
    p = ARCPolicy(capacity=64)
    busy: dict[bytes, int] = {}
    p.busy = busy
    _fill(p.t1, t1, busy)
    _fill(p.t2, t2, busy, base=100)
    p.target_t1_size = float(target)
    before1, before2 = _state(p.t1, busy), _state(p.t2, busy)
    protected = _protected(data, [h for h, _ in before1 + before2])
    expected = _arc_pick(before1, before2, target, n, protected)
    got = p.evict(n, protected)
    if expected is None:
        assert got is None
        assert (_state(p.t1, busy), _state(p.t2, busy)) == (before1, before2)
        assert not (p.t1.parked or p.t2.parked or p.b1 or p.b2)
        return
    v1, v2, done1, done2 = expected
    assert got is not None and [h for h, _ in got] == v1 + v2
    assert _state(p.t1, busy) == _after(before1, v1, done1)
    assert _state(p.t2, busy) == _after(before2, v2, done2)
    assert (list(p.b1), list(p.b2)) == (v1, v2)
    assert p.evictions == {"t1": len(v1), "t2": len(v2)}


def test_recency_list_take_rollback_restores_order() -> None:
    lst = RecencyList()
    busy: dict[bytes, int] = {}
    _fill(lst, [0, 1, 0, -1, 0], busy)
    before = _state(lst, busy)
    taken = Taken()
    assert [h for h, _ in lst.take(2, {bh(0)}, busy, taken)] == [bh(2), bh(4)]
    lst.rollback(taken)
    assert _state(lst, busy) == before and not lst.parked


def test_lru_policy_parks_and_releases_through_the_seam() -> None:
    p = LRUPolicy(capacity=4)
    p.busy = busy = {bh(1): 1}  # pinned
    p.insert([bh(1), bh(2), bh(3)], [10, 20, 30])
    victims = p.evict(1, ())
    assert victims == [(bh(2), 20)]
    assert p.blocks.parked == {bh(1): 10}
    assert p.get(bh(1)) == 10 and bh(1) in p and len(p) == 2
    assert p.get_idle(bh(3)) == 30  # exact for blocks that are not busy
    assert p.get_many([bh(3), bh(1), bh(9)]) == [30, 10, None]
    assert p.absent([bh(1), bh(3), bh(9)]) == [bh(9)]
    del busy[bh(1)]
    p.released([bh(1)])
    assert not p.blocks.parked and list(p.blocks) == [bh(3), bh(1)]
    assert p.get_idle(bh(1)) == 10
    assert p.remove(bh(1)) == 10 and p.remove(bh(1)) is None


def test_arc_parked_t1_block_touched_while_pinned_returns_to_t2() -> None:
    p = ARCPolicy(capacity=8)
    p.busy = busy = {bh(0): 1}  # pinned
    p.insert([bh(0), bh(1), bh(2)], [0, 1, 2])
    assert p.evict(1, ()) == [(bh(1), 1)]
    assert list(p.t1.parked) == [bh(0)]
    p.touch([bh(0)])  # a second use while parked: T2's now
    assert bh(0) in p.t2 and bh(0) not in p.t1
    assert p.get(bh(0)) == 0  # handle 0 is found (not mistaken for a miss)
    del busy[bh(0)]
    p.released([bh(0)])
    assert list(p.t2.order) == [bh(0)] and not p.t2.parked


def test_recency_list_is_a_mapping_in_eviction_order() -> None:
    lst = RecencyList()
    busy: dict[bytes, int] = {bh(0): 1}
    _fill(lst, [1, 0, 0], busy)  # handles 0, 1, 2; bh(0) pinned
    taken = Taken()
    assert lst.take(1, (), busy, taken) == [(bh(1), 1)]
    lst.commit(taken)  # bh(0) parked: last in eviction order
    assert list(lst) == [bh(2), bh(0)] and len(lst) == 2
    assert lst[bh(0)] == 0 and lst.get(bh(0)) == 0  # handle 0 is a value, not a miss
    assert lst.get(bh(9)) is None and lst.get(bh(9), -1) == -1
    assert dict(lst.items()) == {bh(2): 2, bh(0): 0}
    with pytest.raises(KeyError):
        lst[bh(9)]
