"""The hint window of a manager: tickets, errors, stats, and that it is the
manager's (it survives policy switches and clears) while policies that do
not use hints behave exactly as if there were none."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import (
    ARCOffloadingManager,
    BlockStateError,
    CPUBackend,
    KVOffloadError,
    LRUOffloadingManager,
    PolicyOffloadingManager,
    PrepareStoreOutput,
    UnknownTicketError,
    WindowStats,
)
from kvoffload.abstract import SupportsHints
from kvoffload.policies import EvictionPolicy, available_policies
from kvoffload.policies.lru import LRUPolicy

from .fakes import bh, bhs, manager_state, store

#: the policies that take no notice of hints
HINTLESS = ("lru", "arc", "kvarc")


def test_hint_hands_out_tickets_in_order_and_stats_show_the_window(
    manager: PolicyOffloadingManager,
) -> None:
    store(manager, 1, 2)
    assert manager.stats().window == WindowStats(requests=0, uses=0, blocks=0, resident=0)
    first = manager.hint(bhs(1, 3, 1))
    second = manager.hint(iter(bhs(3, 4)))  # any iterable
    assert second > first
    assert manager.stats().window == WindowStats(requests=2, uses=5, blocks=3, resident=1)
    manager.unhint(second)  # out of order
    assert manager.stats().window == WindowStats(requests=1, uses=3, blocks=2, resident=1)
    manager.unhint(first)
    assert manager.stats().window == WindowStats(requests=0, uses=0, blocks=0, resident=0)
    assert manager.hint([]) > second


def test_unhint_of_a_ticket_not_in_the_window_says_so_and_changes_nothing(
    manager: PolicyOffloadingManager,
) -> None:
    ticket = manager.hint(bhs(1, 2))
    gone = manager.hint(bhs(3))
    manager.unhint(gone)
    window = manager.stats().window
    for bad in (gone, 0, -1, gone + 1, 2**70, "1", 1.5, True):
        with pytest.raises(UnknownTicketError, match="is not in the window") as info:
            manager.unhint(bad)  # type: ignore[arg-type]
        assert isinstance(info.value, KeyError) and isinstance(info.value, KVOffloadError)
        assert str(info.value).startswith(f"hint ticket {bad!r} ")  # not quoted like a KeyError
        assert manager.stats().window == window
    manager.unhint(ticket)


def test_every_manager_takes_hints_vllm_named_ones_too() -> None:
    for m in (
        LRUOffloadingManager(CPUBackend(16, 4)),
        ARCOffloadingManager(CPUBackend(16, 4)),
        PolicyOffloadingManager(CPUBackend(16, 4), policy="kvarc"),
    ):
        assert isinstance(m, SupportsHints)
        m.unhint(m.hint(bhs(1)))


def test_policies_that_ignore_hints_have_no_counters(manager: PolicyOffloadingManager) -> None:
    assert LRUPolicy.counters is EvictionPolicy.counters
    if manager.policy_name in HINTLESS:
        assert manager.stats().policy_counters == {}


@pytest.mark.parametrize("to", available_policies())
def test_the_window_survives_a_switch_both_ways(policy: str, to: str) -> None:
    m = PolicyOffloadingManager(CPUBackend(16, 4), policy=policy)
    store(m, 1, 2, 3)
    tickets = [m.hint(bhs(1, 5)), m.hint(bhs(2)), m.hint(bhs(6, 1))]
    window = m.stats().window
    assert window == WindowStats(requests=3, uses=5, blocks=4, resident=2)
    m.switch_policy(to)
    assert m.stats().window == window
    m.unhint(tickets.pop(1))
    m.switch_policy(policy)
    assert m.stats().window == WindowStats(requests=2, uses=4, blocks=3, resident=1)
    for ticket in tickets:
        m.unhint(ticket)
    assert m.stats().window.requests == 0 and len(m) == 3


def test_clear_keeps_the_window(manager: PolicyOffloadingManager) -> None:
    store(manager, 1, 2)
    ticket = manager.hint(bhs(2, 7))
    assert manager.stats().window.resident == 1
    manager.clear()
    assert len(manager) == 0
    assert manager.stats().window == WindowStats(requests=1, uses=2, blocks=2, resident=0)
    store(manager, 2)  # the request is still coming: its block counts again once stored
    assert manager.stats().window.resident == 1
    manager.unhint(ticket)
    assert manager.stats().window == WindowStats(requests=0, uses=0, blocks=0, resident=0)


# -- hints change nothing for the policies that ignore them ---------------------

UNIVERSE = 10
ids = st.lists(st.integers(0, UNIVERSE - 1), max_size=5)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("touch"), ids),
        st.tuples(st.just("lookup"), ids),
        st.tuples(st.just("store"), ids),
        st.tuples(st.just("prepare_store"), ids),
        st.tuples(st.just("complete_store"), ids, st.booleans()),
        st.tuples(st.just("prepare_load"), ids),
        st.tuples(st.just("complete_load"), ids),
        st.tuples(st.just("clear")),
        st.tuples(st.just("switch"), st.sampled_from(HINTLESS)),
        # only the hinted manager sees these two
        st.tuples(st.just("hint"), ids),
        st.tuples(st.just("unhint"), st.integers(0, 3)),
    ),
    max_size=60,
)


def _ids(spec: Any) -> list[int]:
    return [int(i) for i in spec.block_ids]


def _answer(out: Any) -> Any:
    if isinstance(out, PrepareStoreOutput):
        return out.block_hashes_to_store, out.block_hashes_evicted, _ids(out.store_spec)
    return _ids(out) if hasattr(out, "block_ids") else out


def _state(m: PolicyOffloadingManager) -> dict[str, Any]:
    """:func:`manager_state` without the policy's bound methods (one table's each)."""
    state = manager_state(m)
    state["policy"] = {k: v for k, v in state["policy"].items() if not callable(v)}
    return state


def _run(m: PolicyOffloadingManager, op: tuple[Any, ...], tickets: list[int]) -> Any:
    kind = op[0]
    try:
        if kind == "store":
            out = m.prepare_store(bhs(*op[1]))
            if out is not None:
                m.complete_store(out.block_hashes_to_store)
            return _answer(out)
        if kind == "complete_store":
            return m.complete_store(bhs(*op[1]), success=op[2])
        if kind == "clear":
            return m.clear()
        if kind == "switch":
            return m.switch_policy(op[1])
        if kind == "hint":
            tickets.append(m.hint(bhs(*op[1])))
            return None
        if kind == "unhint":
            if tickets:
                m.unhint(tickets.pop(op[1] % len(tickets)))
            return None
        return _answer(getattr(m, kind)(bhs(*op[1])))
    except BlockStateError as e:
        return ("raised", str(e))


def _log(m: PolicyOffloadingManager) -> list[tuple[Any, ...]]:
    assert m.event_log is not None
    return [(r.seq, r.kind, r.block_hashes, r.detail) for r in m.event_log.read(0).records]


@pytest.mark.parametrize("policy", HINTLESS)
@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 6), program=OPS)
def test_hints_change_nothing_for_policies_that_ignore_them(
    policy: str, capacity: int, program: list[tuple[Any, ...]]
) -> None:
    """The same program with hints interleaved and without: every answer,
    every list in order, the events and the stats (but the window) equal."""
    hinted, plain = (
        PolicyOffloadingManager(
            CPUBackend(16, capacity), policy=policy, enable_events=True, event_log_capacity=10_000
        )
        for _ in range(2)
    )
    tickets: list[int] = []
    for op in program:
        answer = _run(hinted, op, tickets)
        if op[0] not in ("hint", "unhint"):
            assert answer == _run(plain, op, [])
        assert _state(hinted) == _state(plain)
    assert _log(hinted) == _log(plain)
    s_hinted, s_plain = hinted.stats(), plain.stats()
    assert s_hinted.counters == s_plain.counters
    assert s_hinted.policy_counters == s_plain.policy_counters == {}
    assert s_hinted.window.requests == len(tickets)


def test_hinted_ghosts_and_unknown_hashes_stay_invisible() -> None:
    m = PolicyOffloadingManager(CPUBackend(16, 2), policy="arc")
    store(m, 1, 2)
    store(m, 3)  # evicts 1: a ghost
    ticket = m.hint(bhs(1, 9))
    assert bh(1) not in m and bh(9) not in m and m.lookup(bhs(9)) == 0
    assert m.stats().lists["b1"] == 1 and len(m) == 2
    m.unhint(ticket)
