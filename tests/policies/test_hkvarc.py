"""What is specific to the ``hkvarc`` policy: kvarc exactly without hints;
with them, hinted blocks held by class, evicted last (farthest next use
first), stores declined that would evict nearer ones, and its counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import BlockHash, BlockStateError, CPUBackend, PolicyOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.policies.arc import T1, T2
from kvoffload.policies.hkvarc import HKVARCPolicy
from kvoffload.replay import ReplayTrace, parse_capacity, replay
from kvoffload.runtime.trace import load_mooncake_trace
from kvoffload.table import TAGS

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
COUNTERS = {"deferred", "redirected", "declined_blocks", "hinted_hits"}


def _hs(*ids: int) -> list[BlockHash]:
    return [BlockHash(b"b%d" % i) for i in ids]


def _manager(capacity: int, policy: str = "hkvarc") -> PolicyOffloadingManager:
    return PolicyOffloadingManager(CPUBackend(16, capacity), policy=policy, enable_events=True)


def _store(m: PolicyOffloadingManager, *ids: int) -> Any:
    out = m.prepare_store(_hs(*ids))
    assert out is not None
    m.complete_store(out.block_hashes_to_store)
    return out


def _policy(m: PolicyOffloadingManager) -> HKVARCPolicy:
    assert isinstance(m.policy, HKVARCPolicy)
    return m.policy


def _lists(m: PolicyOffloadingManager) -> dict[str, int]:
    return dict(m.stats().lists)


# -- no hints: kvarc exactly --------------------------------------------------

UNIVERSE = 12
ids = st.lists(st.integers(0, UNIVERSE - 1), max_size=6)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("touch"), ids),
        st.tuples(st.just("lookup"), ids),
        st.tuples(st.just("store"), ids),
        st.tuples(st.just("store"), ids),
        st.tuples(st.just("prepare_store"), ids),
        st.tuples(st.just("complete_store"), ids, st.booleans()),
        st.tuples(st.just("prepare_load"), ids),
        st.tuples(st.just("complete_load"), ids),
        st.tuples(st.just("clear")),
    ),
    max_size=80,
)


def _answer(m: PolicyOffloadingManager, op: tuple[Any, ...]) -> Any:
    kind = op[0]
    try:
        if kind == "store":
            out = m.prepare_store(_hs(*op[1]))
            if out is None:
                return None
            m.complete_store(out.block_hashes_to_store)
            kind, op = "prepared", ("", [])
        elif kind == "complete_store":
            return m.complete_store(_hs(*op[1]), success=op[2])
        elif kind == "clear":
            return m.clear()
        else:
            out = getattr(m, kind)(_hs(*op[1]))
        if hasattr(out, "store_spec"):
            return (
                out.block_hashes_to_store,
                out.block_hashes_evicted,
                list(out.store_spec.block_ids),
            )
        return list(out.block_ids) if hasattr(out, "block_ids") else out
    except BlockStateError as e:
        return ("raised", str(e))


def _table(m: PolicyOffloadingManager) -> list[list[tuple[Any, ...]]]:
    t = m.table
    return [[(h, handle, t.ref(h)) for h, handle in t.items(tag)] for tag in range(TAGS)]


def _log(m: PolicyOffloadingManager) -> list[tuple[Any, ...]]:
    assert m.event_log is not None
    return [(r.seq, r.kind, r.block_hashes, r.detail) for r in m.event_log.read(0).records]


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 8), program=OPS, target=st.none() | st.floats(0, 1))
def test_hkvarc_without_hints_is_kvarc_exactly(
    capacity: int, program: list[tuple[Any, ...]], target: float | None
) -> None:
    """The same program on both: every answer, every list in order (ghosts
    too), every event and every count equal."""
    ours, kvarc = _manager(capacity), _manager(capacity, "kvarc")
    if target is not None:  # start elsewhere than half the capacity
        _policy(ours).target_t1_size = kvarc.policy.target_t1_size = target * capacity  # type: ignore[attr-defined]
    for op in program:
        assert _answer(ours, op) == _answer(kvarc, op), op
        assert _table(ours) == _table(kvarc)
        assert _policy(ours).target_t1_size == kvarc.policy.target_t1_size  # type: ignore[attr-defined]
    assert _log(ours) == _log(kvarc)
    s, k = ours.stats(), kvarc.stats()
    assert dict(s.lists) == {**k.lists, "h1": 0, "h2": 0}
    assert dict(s.counters.evictions) == {**k.counters.evictions, "h1": 0, "h2": 0}
    assert s.counters.ghost_hits == k.counters.ghost_hits
    assert (s.counters.hit_blocks, s.counters.store_blocks) == (
        k.counters.hit_blocks,
        k.counters.store_blocks,
    )
    # nothing held: T1 in line is held to kvarc's own target
    target = k.params["target_t1_size"]
    assert s.params == {**k.params, "target_t1_in_line": target}
    assert s.policy_counters == dict.fromkeys(COUNTERS, 0)


@pytest.mark.parametrize("trace", ["conversation", "synthetic"])
def test_hkvarc_replays_the_shared_traces_as_kvarc_does(trace: str) -> None:
    workload = load_mooncake_trace(TRACES / f"mooncake_{trace}_trace.jsonl")
    t = ReplayTrace.from_requests(workload, name=trace, trace_block_size=workload.trace_block_size)
    for spec in ("5%", "10%"):
        capacity = parse_capacity(spec, t.unique_blocks)
        ours, kvarc = (replay(t, policy=p, capacity=capacity) for p in ("hkvarc", "kvarc"))
        assert (ours.hit_blocks, ours.evictions, ours.rejected_stores) == (
            kvarc.hit_blocks,
            kvarc.evictions,
            kvarc.rejected_stores,
        )


# -- with hints ------------------------------------------------------------------


def test_hkvarc_holds_hinted_blocks_by_class_until_their_request_is_served() -> None:
    m = _manager(6)
    _store(m, 1, 2, 3)
    m.touch(_hs(3))  # 3 in T2
    assert _lists(m) == {"t1": 2, "t2": 1, "h1": 0, "h2": 0, "b1": 0, "b2": 0}
    ticket = m.hint(_hs(2, 3, 9))
    s = m.stats()
    assert dict(s.lists) == {"t1": 1, "t2": 0, "h1": 1, "h2": 1, "b1": 0, "b2": 0}
    assert sum(s.resident_lists.values()) == s.used and s.ghost_list_names == {"b1", "b2"}
    assert s.policy_counters["deferred"] == 2
    # served: unhinted (2 and 3 were found), then touched as kvarc would
    m.unhint(ticket)
    m.touch(_hs(2, 3, 9))
    assert _lists(m) == {"t1": 1, "t2": 2, "h1": 0, "h2": 0, "b1": 0, "b2": 0}
    assert list(_policy(m).t2) == _hs(3, 2)  # the first hash most recent
    assert m.stats().policy_counters == {
        "deferred": 2,
        "redirected": 0,
        "declined_blocks": 0,
        "hinted_hits": 2,  # 2 and 3 were resident and ready as it left the window
    }


def test_hkvarc_counts_the_hits_hinted_requests_find() -> None:
    m = _manager(6)
    _store(m, 1, 2, 3)
    first = m.hint(_hs(1, 2, 7, 3))  # finds 1, 2: the prefix resident
    second = m.hint(_hs(8, 1))  # finds nothing: 8 is not offloaded
    m.unhint(second)
    m.unhint(first)
    assert m.stats().policy_counters["hinted_hits"] == 2


def test_hkvarc_evicts_unhinted_blocks_first_then_held_ones_farthest_first() -> None:
    m = _manager(4)
    _store(m, 1, 2, 3, 4)
    m.touch(_hs(2))  # 2 in T2
    tickets = [m.hint(_hs(6, 7, 8, 9)), m.hint(_hs(1, 4)), m.hint(_hs(2))]
    # 3 is the only block no waiting request uses; then the held ones,
    # farthest next use first: 2, then the chain 1, 4 tail first
    out = m.prepare_store(_hs(6, 7, 8, 9))
    assert out is not None and out.block_hashes_to_store == _hs(6, 7, 8, 9)
    assert out.block_hashes_evicted == _hs(3, 2, 4, 1)
    m.complete_store(out.block_hashes_to_store)
    s = m.stats()
    # victims become ghosts by class: 4 and 1 were T1 blocks, 2 a T2 one
    assert list(_policy(m).b1) == _hs(3, 4, 1) and list(_policy(m).b2) == _hs(2)
    assert s.counters.evictions == {"t1": 1, "t2": 0, "h1": 2, "h2": 1}
    assert s.policy_counters["redirected"] == 3
    assert dict(s.lists) == {"t1": 0, "t2": 0, "h1": 4, "h2": 0, "b1": 3, "b2": 1}
    assert m.event_log is not None
    (removed,) = [r.detail for r in m.event_log.read(0).records if r.kind == "removed"]
    assert removed == {"t1": "1", "h1": "2", "h2": "1"}
    for ticket in tickets:
        m.unhint(ticket)


def test_hkvarc_scales_kvarcs_t1_target_to_the_blocks_in_line() -> None:
    m = _manager(10)  # kvarc's T1 target starts at 5
    _store(m, 1, 2, 3, 4, 5, 6)
    m.touch(_hs(1, 2, 3, 4, 5, 6))  # all six in T2, 6 the oldest
    _store(m, 11, 12, 13, 14)  # T1, 14 (the prompt's tail) at its cold end
    ticket = m.hint(_hs(1, 2, 3, 4))  # four T2 blocks held
    assert _lists(m) == {"t1": 4, "t2": 2, "h1": 0, "h2": 4, "b1": 0, "b2": 0}
    assert m.stats().params == {"target_t1_size": 5.0, "target_t1_in_line": 3.0}
    # Six blocks are in kvarc's order, so T1's share of them is 5 * 6 / 10 = 3:
    # T1 (4, and the one stored) is over it and gives the victim. Counting
    # the target against the whole cache (T1 at 5, under 5) took T2's oldest.
    out = m.prepare_store(_hs(20))
    assert out is not None and out.block_hashes_evicted == _hs(14)
    m.complete_store(out.block_hashes_to_store)
    m.unhint(ticket)
    # nothing held: kvarc's own target (T1 at 4 + 1, not over 5: T2's oldest)
    out = m.prepare_store(_hs(21))
    assert out is not None and out.block_hashes_evicted == _hs(6)


def test_hkvarc_declines_blocks_it_would_evict_a_nearer_one_for() -> None:
    m = _manager(3)
    _store(m, 1, 2, 3)
    soon = m.hint(_hs(1, 2))
    middle = m.hint(_hs(5))
    late = m.hint(_hs(3))
    # 5 and 6 need two slots and every block is held: 5 is used before 3
    # (the farthest held block), 6 by no waiting request: only 5 is stored
    out = m.prepare_store(_hs(5, 6))
    assert out is not None
    assert out.block_hashes_to_store == _hs(5) and out.block_hashes_evicted == _hs(3)
    assert list(out.store_spec.block_ids) == [2]  # type: ignore[attr-defined]
    with pytest.raises(BlockStateError):
        m.complete_store(_hs(6))  # declined: never prepared
    m.complete_store(out.block_hashes_to_store)
    s = m.stats()
    assert s.policy_counters["declined_blocks"] == 1 and s.counters.store_blocks["stored"] == 4
    assert s.counters.store_blocks["skipped_present"] == 0
    # a store that room in T1/T2 covers is never declined
    for ticket in (soon, middle, late):
        m.unhint(ticket)
    out = m.prepare_store(_hs(6))
    assert out is not None and out.block_hashes_to_store == _hs(6)
    assert m.stats().policy_counters["declined_blocks"] == 1


def test_hkvarc_declines_nothing_that_a_block_in_line_has_room_for() -> None:
    # 1 is held and named by the store; 2 is in line and idle. The manager
    # subtracted 1 twice (hinted, and named), so it asked admit, and admit
    # kept nothing as no held block could be evicted: 3 was declined
    m = _manager(2)
    _store(m, 1)
    _store(m, 2)
    m.hint(_hs(1))
    out = m.prepare_store(_hs(1, 3))
    assert out is not None
    assert out.block_hashes_to_store == _hs(3) and out.block_hashes_evicted == _hs(2)
    assert m.stats().policy_counters["declined_blocks"] == 0


@pytest.mark.parametrize("busy", ["in flight", "pinned"])
def test_hkvarc_declines_rather_than_evict_a_held_block_when_the_others_are_busy(
    busy: str,
) -> None:
    # 2 is busy (a store in flight, or a load): no victim. The manager
    # counted it as room and never asked admit, so the held 1 was evicted
    # for 3, which no waiting request uses
    m = _manager(2)
    _store(m, 1)
    m.hint(_hs(1))
    if busy == "in flight":
        assert m.prepare_store(_hs(2)) is not None
    else:
        _store(m, 2)
        m.prepare_load(_hs(2))
    out = m.prepare_store(_hs(3))
    assert out is not None
    assert out.block_hashes_to_store == [] and out.block_hashes_evicted == []
    counters = m.stats().policy_counters
    assert counters["declined_blocks"] == 1 and counters["redirected"] == 0
    assert BlockHash(b"b1") in m.table


def test_hkvarc_store_without_room_is_rejected_not_declined() -> None:
    # the only block is named by the store: there is no room at all, as
    # kvarc answers (None, a rejected store); admit counted the named block
    # as room and declined 3 instead
    m = _manager(1)
    _store(m, 1)
    m.hint(_hs(9))
    assert m.prepare_store(_hs(1, 3)) is None
    s = m.stats()
    assert s.counters.rejected_stores == 1 and s.policy_counters["declined_blocks"] == 0


def test_hkvarc_compares_each_block_with_the_held_block_its_store_evicts() -> None:
    # 3 then 4 each evict a held block, farthest first: 3 (used second)
    # evicts 2 (used last), then 4 (used second too) would evict 1 (used
    # first): 4 is declined. Each was compared with the farthest, 2, so
    # both were stored and 1 evicted
    m = _manager(2)
    _store(m, 2)
    _store(m, 1)
    m.hint(_hs(1))
    m.hint(_hs(3, 4))
    m.hint(_hs(2))
    out = m.prepare_store(_hs(3, 4))
    assert out is not None
    assert out.block_hashes_to_store == _hs(3) and out.block_hashes_evicted == _hs(2)
    assert m.stats().policy_counters["declined_blocks"] == 1


def test_hkvarc_declines_nothing_with_an_empty_window() -> None:
    m = _manager(2)
    _store(m, 1, 2)
    m.unhint(m.hint(_hs(1, 2)))
    out = m.prepare_store(_hs(3, 4))
    assert out is not None and out.block_hashes_to_store == _hs(3, 4)


def test_hkvarc_orders_held_blocks_last_for_the_next_policy() -> None:
    m = _manager(5)
    _store(m, 1, 2, 3, 4, 5)
    m.touch(_hs(5))
    m.hint(_hs(3))
    m.hint(_hs(5, 1))
    # T1 in line (tail first), T2 in line, then held: 1 (farthest), 5, 3
    assert [h for h, _ in _policy(m).ordered_items()] == _hs(4, 2, 1, 5, 3)


@pytest.mark.parametrize("other", sorted(set(available_policies()) - {"hkvarc"}))
def test_switching_to_hkvarc_holds_the_window_and_away_releases_it(other: str) -> None:
    m = _manager(6, other)
    _store(m, 1, 2, 3, 4)
    ticket = m.hint(_hs(2, 4, 8))
    m.switch_policy("hkvarc")
    s = m.stats()
    assert s.lists["h1"] == 2 and s.lists["t1"] == 2
    assert s.policy_counters == {**dict.fromkeys(COUNTERS, 0), "deferred": 2}
    m.switch_policy(other)
    assert m.table.held(T1) == m.table.held(T2) == 0
    assert sum(m.stats().resident_lists.values()) == 4
    assert m.stats().policy_counters == {}
    m.switch_policy("hkvarc")  # and back: held again, added to what it counted before
    assert m.stats().policy_counters["deferred"] == 2 + 2
    m.unhint(ticket)
    assert m.stats().lists["h1"] == 0 and len(m) == 4


def test_clear_evicts_held_blocks_too_and_keeps_the_window() -> None:
    m = _manager(4)
    _store(m, 1, 2, 3)
    ticket = m.hint(_hs(1, 2))
    assert sorted(m.clear()) == _hs(1, 2, 3)
    assert len(m) == 0 and m.stats().window.requests == 1
    _store(m, 1)
    assert m.stats().lists["h1"] == 1  # still coming: held once stored again
    m.unhint(ticket)


def test_a_store_that_fails_anyway_declines_nothing() -> None:
    """Capacity 1, its block pinned: a store of a hinted and an unhinted
    block cannot evict anything, so it is refused (None), both blocks counted
    rejected and none declined (once 1 declined and 1 rejected)."""
    m = PolicyOffloadingManager(CPUBackend(16, 1), policy="hkvarc")
    m.complete_store(m.prepare_store([b"a"]).block_hashes_to_store)
    m.prepare_load([b"a"])
    m.hint([b"x"])
    assert m.prepare_store([b"x", b"y"]) is None
    s = m.stats()
    assert s.policy_counters["declined_blocks"] == 0
    assert s.counters.store_blocks["rejected_no_room"] == 2


def test_a_reset_counts_the_held_blocks_it_evicts_as_redirected() -> None:
    # docs/api.md (reset): counters continue, and the blocks a reset evicts
    # count as evictions of the lists they leave, held ones under h1/h2 and
    # so in `redirected`, as every eviction of a held block
    m = _manager(8)
    _store(m, 1, 2, 3, 4)
    m.hint(_hs(1, 2))
    assert _lists(m)["h1"] == 2 and m.stats().policy_counters["redirected"] == 0
    assert sorted(m.clear()) == sorted(_hs(1, 2, 3, 4))
    assert m.stats().counters.evictions == {"t1": 2, "t2": 0, "h1": 2, "h2": 0}
    assert m.stats().policy_counters["redirected"] == 2
