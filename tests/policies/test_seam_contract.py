"""The seam contract, under any call sequence, for the policies that are
not registered (registered ones run tests/core's contract suite and state
machine through a manager): a policy-level model with the busy table a
manager would keep, and each policy's own invariants on top."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstract import BlockHash
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.kvarc import GHOST_FACTOR as KVARC_GHOSTS
from kvoffload.policies.kvarc import KVARCPolicy
from kvoffload.policies.reuse import GHOST_FACTOR as REUSE_GHOSTS
from kvoffload.policies.reuse import ReusePolicy

CAPACITY = 12


def _h(i: int) -> BlockHash:
    return BlockHash(b"h%d" % i)


def _reuse_invariants(p: EvictionPolicy, resident: int) -> None:
    sizes = p.list_sizes()
    assert sizes["new"] + sizes["reused"] == resident
    assert sizes["ghost"] <= REUSE_GHOSTS * CAPACITY


def _kvarc_invariants(p: EvictionPolicy, resident: int) -> None:
    assert isinstance(p, KVARCPolicy)
    sizes = p.list_sizes()
    assert sizes["t1"] + sizes["t2"] == resident
    assert max(sizes["b1"], sizes["b2"]) <= 2 * KVARC_GHOSTS * CAPACITY
    assert not (set(p.b1) | set(p.b2)) & {h for h, _ in p.ordered_items()}
    assert 0.0 <= p.target_t1_size <= CAPACITY


POLICIES: dict[
    str, tuple[Callable[[int], EvictionPolicy], Callable[[EvictionPolicy, int], None]]
] = {
    "reuse": (ReusePolicy, _reuse_invariants),
    "kvarc": (KVARCPolicy, _kvarc_invariants),
}

ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(st.integers(0, 40), min_size=1, max_size=6)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 40), max_size=6)),
        st.tuples(st.just("pin"), st.integers(0, 40)),
        st.tuples(st.just("unpin"), st.integers(0, 40)),
        st.tuples(st.just("evict"), st.integers(1, 5), st.lists(st.integers(0, 40), max_size=3)),
        st.tuples(st.just("remove"), st.integers(0, 40)),
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
    p = make(CAPACITY)
    busy: dict[BlockHash, int] = {}
    p.busy = busy
    model: dict[BlockHash, int] = {}  # hash -> handle (its id)
    for call in calls:
        kind = call[0]
        if kind == "store":  # insert in flight, then the store completes
            ids = [i for i in dict.fromkeys(call[1]) if _h(i) not in model]  # type: ignore[attr-defined]
            ids = ids[: CAPACITY - len(model)]
            if ids:
                hashes = [_h(i) for i in ids]
                busy.update(dict.fromkeys(hashes, -1))
                p.insert(hashes, ids)
                for h in hashes:
                    del busy[h]
                p.stored(hashes)
                model.update(zip(hashes, ids, strict=True))
        elif kind == "touch":
            p.touch([_h(i) for i in call[1]])  # type: ignore[attr-defined]
        elif kind in ("pin", "unpin") and _h(call[1]) in model:  # type: ignore[arg-type]
            h = _h(call[1])  # type: ignore[arg-type]
            if kind == "pin":
                busy[h] = busy.get(h, 0) + 1
            elif busy.get(h, 0) > 0:
                busy[h] -= 1
                if busy[h] == 0:
                    del busy[h]
                    p.released([h])
        elif kind == "evict":
            n, named = call[1], {_h(i) for i in call[2]}  # type: ignore[attr-defined]
            before = sorted(h for h, _ in p.ordered_items())
            out = p.evict(n, named)  # type: ignore[arg-type]
            evictable = [h for h in model if h not in busy and h not in named]
            if out is None:
                assert len(evictable) < n
                assert sorted(h for h, _ in p.ordered_items()) == before
            else:
                assert len(out) == n == len({h for h, _ in out})
                for h, handle in out:
                    assert h in evictable and model.pop(h) == handle
        elif kind == "remove":
            h = _h(call[1])  # type: ignore[arg-type]
            assert p.remove(h) == model.pop(h, None)
            busy.pop(h, None)
        assert len(p) == len(model)
        assert dict(p.ordered_items()) == model
        assert all(p.get(h) == handle for h, handle in model.items())
        invariants(p, len(model))
