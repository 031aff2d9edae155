"""Batched eviction (the table's ``evict``, as the LRU and ARC policies
drive it) picks exactly what a block-by-block scan picks, leaves every other
block in its place (busy ones it passed included, as vLLM's scan does), and
a failed eviction changes nothing; on random states, for LRU and ARC, on
both block tables (C and the Python reference)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.policies.arc import B1, B2, T1, T2, ARCPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.lru import LRU, LRUPolicy

from .fakes import TABLES, bh

# a block's state: -1 in flight, 0 evictable, > 0 pinned
states = st.lists(st.sampled_from([-1, 0, 0, 0, 1, 2]), min_size=0, max_size=24)

State = list[tuple[bytes, int]]


def _policy(cls: type[EvictionPolicy], table_cls: type, capacity: int = 64) -> Any:
    p = cls(capacity, table_cls())
    p.seed([])
    return p


def _fill(p: EvictionPolicy, tag: int, refs: list[int], base: int = 0) -> None:
    """Blocks ``bh(base + i)`` with handle ``base + i`` in list ``tag``,
    busy as ``refs`` says."""
    hashes = [bh(base + i) for i in range(len(refs))]
    p.table.insert(hashes, [base + i for i in range(len(refs))], tag)
    p.table.complete([h for h, r in zip(hashes, refs, strict=True) if r >= 0])
    p.table.pin([h for h, r in zip(hashes, refs, strict=True) for _ in range(max(r, 0))])


def _state(p: EvictionPolicy, tag: int) -> State:
    return [(h, p.table.ref(h)) for h in p.table.keys(tag)]


def _pick(state: State, n: int, protected: set[bytes]) -> list[bytes]:
    """Up to ``n`` oldest evictable, unprotected hashes, by a plain scan."""
    return [h for h, r in state if r == 0 and h not in protected][:n]


def _after(state: State, victims: list[bytes]) -> State:
    """The list after evicting ``victims``: the others in their order."""
    return [e for e in state if e[0] not in victims]


def _protected(data: st.DataObject, hashes: list[bytes]) -> set[bytes]:
    return set(data.draw(st.lists(st.sampled_from(hashes or [bh(999)]), max_size=6)))


@pytest.mark.parametrize("table_cls", TABLES)
@settings(max_examples=300, deadline=None)
@given(refs=states, n=st.integers(1, 12), data=st.data())
def test_lru_eviction_matches_a_scan(
    table_cls: type, refs: list[int], n: int, data: st.DataObject
) -> None:
    p = _policy(LRUPolicy, table_cls)
    _fill(p, LRU, refs)
    before = _state(p, LRU)
    protected = _protected(data, [h for h, _ in before])
    expected = _pick(before, n, protected)
    victims = p.evict(n, protected)
    if len(expected) < n:
        assert victims is None
        assert _state(p, LRU) == before  # nothing changed
        return
    assert victims is not None and victims[0] == expected
    assert victims[1] == [int(h[1:]) for h in expected]  # the handles, in order
    assert _state(p, LRU) == _after(before, expected)
    assert p.evictions == {"lru": n}


def _arc_pick(
    t1: State, t2: State, target: int, n: int, protected: set[bytes]
) -> tuple[list[bytes], list[bytes]] | None:
    """ARC's choice spelled out: T1 while it is at or above the target, then
    T2, then T1 again."""
    ev1 = _pick(t1, len(t1), protected)
    ev2 = _pick(t2, len(t2), protected)
    first = min(n, max(0, len(t1) - target + 1))
    v1 = ev1[:first]
    v2 = ev2[: n - len(v1)]
    if len(v1) + len(v2) < n and len(v1) == first:
        v1 = ev1[: n - len(v2)]
    return (v1, v2) if len(v1) + len(v2) == n else None


@pytest.mark.parametrize("table_cls", TABLES)
@settings(max_examples=300, deadline=None)
@given(t1=states, t2=states, target=st.integers(0, 30), n=st.integers(1, 12), data=st.data())
def test_arc_eviction_matches_its_definition(
    table_cls: type, t1: list[int], t2: list[int], target: int, n: int, data: st.DataObject
) -> None:
    p = _policy(ARCPolicy, table_cls)
    _fill(p, T1, t1)
    _fill(p, T2, t2, base=100)
    p.target_t1_size = float(target)
    before1, before2 = _state(p, T1), _state(p, T2)
    protected = _protected(data, [h for h, _ in before1 + before2])
    expected = _arc_pick(before1, before2, target, n, protected)
    got = p.evict(n, protected)
    table = p.table
    if expected is None:
        assert got is None
        assert (_state(p, T1), _state(p, T2)) == (before1, before2)
        assert not (table.size(B1) or table.size(B2))
        return
    v1, v2 = expected
    assert got is not None and got[0] == v1 + v2
    assert _state(p, T1) == _after(before1, v1)
    assert _state(p, T2) == _after(before2, v2)
    assert (list(p.b1), list(p.b2)) == (v1, v2)
    assert p.evictions == {"t1": len(v1), "t2": len(v2)}


@pytest.mark.parametrize("table_cls", TABLES)
def test_lru_policy_keeps_a_passed_block_in_its_place(table_cls: type) -> None:
    p = _policy(LRUPolicy, table_cls, capacity=4)
    table = p.table
    p.insert([bh(1), bh(2), bh(3)], [10, 20, 30])
    table.complete([bh(1), bh(2), bh(3)])
    table.pin([bh(1)])
    assert p.evict(1, ()) == ([bh(2)], [20])
    assert table.keys(LRU) == [bh(1), bh(3)]
    assert table.get(bh(1)) == 10 and bh(1) in table and len(table) == 2
    assert table.absent([bh(1), bh(3), bh(9)]) == [bh(9)]
    assert table.unpin([bh(1)]) == [bh(1)]  # released: still the oldest
    assert p.evict(1, ()) == ([bh(1)], [10])
    assert table.remove(bh(3)) == 30 and table.remove(bh(3)) is None


@pytest.mark.parametrize("table_cls", TABLES)
def test_arc_t1_block_passed_while_pinned_moves_to_t2_when_touched(table_cls: type) -> None:
    p = _policy(ARCPolicy, table_cls, capacity=8)
    table = p.table
    p.insert([bh(0), bh(1), bh(2)], [0, 1, 2])
    table.complete([bh(0), bh(1), bh(2)])
    table.pin([bh(0)])
    assert p.evict(1, ()) == ([bh(1)], [1])
    assert list(p.t1) == [bh(0), bh(2)]
    p.touch([bh(0)])  # a second use while pinned: T2's most recent, as vLLM's
    assert bh(0) in p.t2 and bh(0) not in p.t1
    assert table.get(bh(0)) == 0  # handle 0 is found (not mistaken for a miss)
    table.unpin([bh(0)])
    assert list(p.t2) == [bh(0)] and list(p.t1) == [bh(2)]


@pytest.mark.parametrize("table_cls", TABLES)
def test_table_list_is_a_mapping_in_eviction_order(table_cls: type) -> None:
    p = _policy(ARCPolicy, table_cls)
    _fill(p, T1, [1, 0, 0])  # handles 0, 1, 2; bh(0) pinned
    assert p.evict(1, ()) == ([bh(1)], [1])  # bh(0) pinned: passed, in its place
    t1 = p.t1
    assert list(t1) == [bh(0), bh(2)] and len(t1) == 2
    assert t1[bh(0)] == 0 and t1.get(bh(0)) == 0  # handle 0 is a value, not a miss
    assert t1.get(bh(9)) is None and t1.get(bh(9), -1) == -1
    assert list(t1.items()) == [(bh(0), 0), (bh(2), 2)]
    assert list(p.b1) == [bh(1)] and p.b1[bh(1)] is None and bh(1) not in t1
    with pytest.raises(KeyError):
        t1[bh(9)]
