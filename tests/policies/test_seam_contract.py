"""The seam contract, under any call sequence, at the policy level (the
registered policies also run tests/core's contract suite and state machine
through a manager): a model of what is resident next to the policy's block
table, and each policy's own invariants on top."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstract import BlockHash
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.hkvarc import HKVARCPolicy
from kvoffload.policies.kvarc import GHOST_FACTOR as KVARC_GHOSTS
from kvoffload.policies.kvarc import KVARCPolicy
from kvoffload.table import BlockTable

CAPACITY = 12


def _h(i: int) -> BlockHash:
    return BlockHash(b"h%d" % i)


def _kvarc_invariants(p: EvictionPolicy, resident: int) -> None:
    assert isinstance(p, KVARCPolicy)
    sizes = p.list_sizes()
    assert sizes["t1"] + sizes["t2"] == resident
    assert max(sizes["b1"], sizes["b2"]) <= 2 * KVARC_GHOSTS * CAPACITY
    assert not (set(p.b1) | set(p.b2)) & {h for h, _ in p.ordered_items()}
    assert 0.0 <= p.target_t1_size <= CAPACITY


def _hkvarc_invariants(p: EvictionPolicy, resident: int) -> None:
    assert isinstance(p, HKVARCPolicy)
    sizes = p.list_sizes()
    assert sizes["t1"] + sizes["t2"] + sizes["h1"] + sizes["h2"] == resident
    assert sizes["h1"] + sizes["h2"] == p.table.window_resident  # every hinted block held
    assert max(sizes["b1"], sizes["b2"]) <= 2 * KVARC_GHOSTS * CAPACITY
    assert not (set(p.b1) | set(p.b2)) & {h for h, _ in p.ordered_items()}
    assert 0.0 <= p.target_t1_size <= CAPACITY


POLICIES: dict[
    str,
    tuple[Callable[[int, BlockTable], EvictionPolicy], Callable[[EvictionPolicy, int], None]],
] = {
    "kvarc": (KVARCPolicy, _kvarc_invariants),
    "hkvarc": (HKVARCPolicy, _hkvarc_invariants),
}

ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(st.integers(0, 40), min_size=1, max_size=6)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 40), max_size=6)),
        st.tuples(st.just("pin"), st.integers(0, 40)),
        st.tuples(st.just("unpin"), st.integers(0, 40)),
        st.tuples(st.just("evict"), st.integers(1, 5), st.lists(st.integers(0, 40), max_size=3)),
        st.tuples(st.just("remove"), st.integers(0, 40)),
        # the window is the table's: hints come from the manager, not the policy
        st.tuples(st.just("hint"), st.lists(st.integers(0, 40), max_size=6)),
        st.tuples(st.just("unhint"), st.integers(0, 3)),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(calls=ops)
def test_policy_keeps_the_seam_contract_under_any_call_sequence(
    name: str, calls: list[tuple[object, ...]]
) -> None:
    make, invariants = POLICIES[name]
    table = BlockTable()
    p = make(CAPACITY, table)
    p.seed([])
    pins: dict[BlockHash, int] = {}
    tickets: list[int] = []
    model: dict[BlockHash, int] = {}  # hash -> handle (its id)
    for call in calls:
        kind = call[0]
        if kind == "store":  # insert in flight, then the store completes
            ids = [i for i in dict.fromkeys(call[1]) if _h(i) not in model]  # type: ignore[attr-defined]
            ids = ids[: CAPACITY - len(model)]
            if ids:
                hashes = [_h(i) for i in ids]
                p.insert(hashes, ids)
                assert table.complete(hashes) == hashes
                model.update(zip(hashes, ids, strict=True))
        elif kind == "touch":
            p.touch([_h(i) for i in call[1]])  # type: ignore[attr-defined]
        elif kind in ("pin", "unpin") and _h(call[1]) in model:  # type: ignore[arg-type]
            h = _h(call[1])  # type: ignore[arg-type]
            if kind == "pin":
                table.pin([h])
                pins[h] = pins.get(h, 0) + 1
            elif pins.get(h, 0) > 0:
                table.unpin([h])
                pins[h] -= 1
                if pins[h] == 0:
                    del pins[h]
        elif kind == "evict":
            n, named = call[1], {_h(i) for i in call[2]}  # type: ignore[attr-defined]
            before = sorted(h for h, _ in p.ordered_items())
            out = p.evict(n, named)  # type: ignore[arg-type]
            evictable = [h for h in model if h not in pins and h not in named]
            if out is None:
                assert len(evictable) < n
                assert sorted(h for h, _ in p.ordered_items()) == before
            else:
                hashes, handles = out
                assert len(hashes) == n == len(set(hashes)) == len(handles)
                for h, handle in zip(hashes, handles, strict=True):
                    assert h in evictable and model.pop(h) == handle
        elif kind == "hint":
            tickets.append(table.hint([_h(i) for i in call[1]]))  # type: ignore[attr-defined]
        elif kind == "unhint" and tickets:
            table.unhint(tickets.pop(call[1] % len(tickets)))  # type: ignore[operator]
        elif kind == "remove":
            h = _h(call[1])  # type: ignore[arg-type]
            assert table.remove(h) == model.pop(h, None)
            pins.pop(h, None)
        assert len(table) == len(model)
        assert dict(p.ordered_items()) == model
        assert all(table.get(h) == handle for h, handle in model.items())
        assert all(table.ref(h) == pins.get(h, 0) for h in model)
        invariants(p, len(model))


def test_a_policy_without_usable_lists_is_refused_with_what_to_do() -> None:
    from enum import IntEnum

    from kvoffload.errors import PolicyError

    class GhostsFirst(IntEnum):
        B = 4
        T = 0

    with pytest.raises(PolicyError, match=r"the first a resident list \(0\.\.3\)"):

        class Backwards(EvictionPolicy):  # the first list must hold resident blocks
            name = "backwards"
            lists = GhostsFirst

    class NoLists(EvictionPolicy):
        name = "nolists"

        def insert(self, block_hashes: object, blocks: object) -> None:
            pass

        def evict(self, n: int, protected: object) -> None:
            return None

    with pytest.raises(PolicyError, match="declares no `lists`: an IntEnum"):
        NoLists(4, BlockTable())  # type: ignore[abstract]
