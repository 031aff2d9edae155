"""Live eviction-policy switch: nothing resident is lost or changed."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvoffload import (
    ARCOffloadingManager,
    CPUBackend,
    LRUOffloadingManager,
    ManagerCounters,
    PolicyError,
    PolicyFailedError,
    PolicyOffloadingManager,
)
from kvoffload.policies import EvictionPolicy, available_policies

from .fakes import bh, bhs, manager_state, ref_cnt, resident, store


def _blocks(m: PolicyOffloadingManager) -> dict[bytes, tuple[int | None, int]]:
    """Each resident block's reference count and block id (its handle)."""
    return {h: (ref_cnt(m, h), handle) for h, handle in m.policy.ordered_items()}


def _monotonic(before: ManagerCounters, after: ManagerCounters) -> None:
    for field in fields(ManagerCounters):
        if field.type == "int":  # the plain counters (mappings are checked by key elsewhere)
            assert getattr(after, field.name) >= getattr(before, field.name), field.name


def _busy_manager(policy: str) -> PolicyOffloadingManager:
    """8 full slots: 2 (pinned twice) and 3 (once) ready, 6-7 in flight, and
    four of 1, 4, 5, 10-12 ready and idle (which four is the policy's
    choice: LRU and ARC evict 10 and 11); ghost history and a ghost hit for ARC."""
    m = PolicyOffloadingManager(CPUBackend(16, 8), policy=policy, enable_events=True)
    store(m, 10, 11, 12)
    store(m, 1, 2, 3, 4, 5)
    m.touch(bhs(4, 2))
    m.prepare_load(bhs(2, 3))
    m.prepare_load(bhs(2))
    out = m.prepare_store(bhs(6, 7))
    assert out is not None and len(set(out.block_hashes_evicted)) == 2
    assert set(out.block_hashes_evicted) <= set(bhs(10, 11, 12, 1, 4, 5))  # never 2 or 3
    m.touch(out.block_hashes_evicted[:1])
    m.lookup(bhs(1, 2, 9))
    return m


def test_switch_lru_arc_lru_keeps_blocks_ids_and_ref_counts() -> None:
    m = _busy_manager("lru")
    blocks = _blocks(m)
    s0 = m.stats()
    assert m.switch_policy("arc") == "lru"
    assert s0.counters.ghost_hits == {}
    assert _blocks(m) == blocks
    s1 = m.stats()
    _monotonic(s0.counters, s1.counters)
    assert m.switch_policy("lru") == "arc"
    assert _blocks(m) == blocks
    s2 = m.stats()
    _monotonic(s1.counters, s2.counters)
    for s in (s1, s2):
        assert (s.used, s.free, s.pinned, s.in_flight) == (8, 0, 2, 2)
    assert s2.policy == "lru" and s2.counters.policy_switches == 2

    # in-flight stores and loads complete normally after the switches
    m.complete_store(bhs(6, 7))
    m.complete_load(bhs(2, 3))
    m.complete_load(bhs(2))
    assert m.lookup(bhs(1, 2, 3, 4, 5, 6, 7)) == 7
    assert m.stats().pinned == 0 and m.stats().in_flight == 0


@pytest.mark.parametrize("target", available_policies())
@pytest.mark.parametrize("source", available_policies())
def test_switch_between_any_two_policies_keeps_protocol_working(source: str, target: str) -> None:
    m = _busy_manager(source)
    blocks = _blocks(m)
    m.switch_policy(target)
    assert m.policy_name == target
    assert _blocks(m) == blocks
    # pinned and in-flight blocks stay protected under the new policy
    out = m.prepare_store(bhs(20, 21, 22))
    assert out is not None
    assert set(out.block_hashes_evicted) <= set(bhs(10, 11, 12, 1, 4, 5))
    m.complete_store(bhs(6, 7, 20, 21, 22), success=False)
    assert bh(6) not in m and bh(20) not in m
    assert m.stats().used + m.stats().free == 8


def test_switch_lru_order_seeds_arc_t1_with_empty_ghosts() -> None:
    m = ARCOffloadingManager(CPUBackend(16, 4))
    m.switch_policy("lru")
    store(m, 1, 2, 3, 4)
    m.touch(bhs(2, 1))  # LRU order 3, 4, 1, 2
    m.switch_policy("arc")
    assert list(m.t1) == bhs(3, 4, 1, 2)
    assert (len(m.t2), len(m.b1), len(m.b2), m.target_t1_size) == (0, 0, 0, 0)


def test_switch_arc_t1_then_t2_order_seeds_lru() -> None:
    m = ARCOffloadingManager(CPUBackend(16, 6))
    store(m, 1, 2, 3, 4, 5)
    m.touch(bhs(4, 2))  # T1 = [1, 3, 5], T2 = [2, 4]
    store(m, 6)
    assert (list(m.t1), list(m.t2)) == (bhs(1, 3, 5, 6), bhs(2, 4))
    m.switch_policy("lru")
    assert resident(m) == bhs(1, 3, 5, 6, 2, 4)
    out = m.prepare_store(bhs(7, 8))
    assert out is not None and out.block_hashes_evicted == bhs(1, 3)


def test_switch_forgets_arc_ghosts_but_keeps_ghost_hit_counts() -> None:
    m = ARCOffloadingManager(CPUBackend(16, 2))
    store(m, 1, 2)
    store(m, 3, 4)  # 1, 2 become B1 ghosts
    m.touch(bhs(1, 2))
    assert m.stats().counters.ghost_hits["b1"] == 2
    m.switch_policy("lru")
    m.switch_policy("arc")
    assert (len(m.b1), len(m.b2)) == (0, 0)
    m.touch(bhs(1))  # no longer a ghost: no hit
    assert m.stats().counters.ghost_hits["b1"] == 2


def test_switch_to_unknown_policy_changes_nothing() -> None:
    m = _busy_manager("arc")
    assert m.stats().counters.ghost_hits["b1"] == 1
    before = manager_state(m)
    switches = m.stats().counters.policy_switches
    with pytest.raises(PolicyError, match=f"valid policies: {', '.join(available_policies())}$"):
        m.switch_policy("clock")
    assert manager_state(m) == before
    assert m.stats().counters.policy_switches == switches


def test_switch_records_an_event_and_keeps_vllm_events_clean() -> None:
    m = LRUOffloadingManager(CPUBackend(16, 4), enable_events=True)
    store(m, 1)
    m.switch_policy("arc")
    assert m.event_log is not None
    last = m.event_log.read().records[-1]
    assert last.kind == "policy_switched"
    assert dict(last.detail) == {"from": "lru", "to": "arc"}
    assert [e.removed for e in m.take_events()] == [False]  # only the store


def _choose(monkeypatch: pytest.MonkeyPatch, cls: type[EvictionPolicy]) -> None:
    """Make ``cls`` the policy its ``name`` names, for this test."""
    import kvoffload.policies as policies

    real = policies.policy_class
    monkeypatch.setattr(policies, "policy_class", lambda n: cls if n == cls.name else real(n))


def test_switch_resets_the_touch_rules_of_the_old_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy that keeps the table's default touch rules must not inherit
    the previous policy's (ARC's would move a touched block to list 1)."""
    from kvoffload.policies.lru import LRUPolicy

    class DefaultRules(LRUPolicy):
        name = "default-rules"

        def seed(self, items: object) -> None:
            self.table.relist([h for h, _ in items], 0)  # type: ignore[attr-defined]

    m = ARCOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3)
    _choose(monkeypatch, DefaultRules)
    m.switch_policy("default-rules")
    m.touch(bhs(1))
    table = m.table
    assert table.keys(0) == bhs(2, 3, 1) and table.size(1) == 0  # LRU order, list 0


@pytest.mark.parametrize("policy", ["arc", "kvarc", "hkvarc", "lru"])
def test_switch_to_the_policy_in_use_changes_nothing(policy: str) -> None:
    """A retried switch must not wipe what the policy learned (it once
    re-made the policy: T2, the ghosts and the target were gone)."""
    from kvoffload.runtime.commands import Command, apply_switch

    m = _busy_manager(policy)
    m.take_events()
    old, order = m.policy, m.policy.ordered_items()
    lists, stats = m.policy.list_sizes(), m.stats()
    for name in (policy, policy.upper()):
        assert m.switch_policy(name) == policy
    assert m.policy is old and m.policy.ordered_items() == order
    assert m.policy.list_sizes() == lists and m.stats() == stats
    assert m.take_events() == []
    # the runtime's command: the version stays too
    detail, version = apply_switch(m, Command("switch_policy", policy=policy), 4)
    assert (detail, version) == ({"from": policy, "to": policy}, 4)
    other = "lru" if policy != "lru" else "arc"
    assert apply_switch(m, Command("switch_policy", policy=other), 4)[1] == 5


def test_a_policy_that_fails_to_seed_leaves_a_working_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A policy of one's own whose seed raises: the switch once left the old
    policy in place with the table's touch rules and ghosts reset under it
    (ARC no longer promoted a touched block to T2)."""
    from kvoffload.policies.lru import LRUPolicy

    class Broken(LRUPolicy):
        name = "broken"

        def seed(self, items: object) -> None:
            raise RuntimeError("seed failed")

    m = ARCOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3)
    _choose(monkeypatch, Broken)
    blocks, evictions = _blocks(m), m.stats().counters.evictions
    with pytest.raises(
        PolicyFailedError, match=r"'broken' failed to take over .*RuntimeError: seed failed"
    ):
        m.switch_policy("broken")
    assert m.policy_name == "arc" and _blocks(m) == blocks
    assert m.stats().counters.evictions == evictions and m.stats().counters.policy_switches == 0
    m.touch(bhs(2))
    assert m.table.tag_of(bh(2)) == 1  # ARC's rules again: a second use is T2


def test_a_policy_whose_constructor_raises_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # found by an audit: the constructor's own error came out of the switch
    # (a 500 from the admin API), not the PolicyError the switch documents
    from kvoffload.policies.lru import LRUPolicy

    class Unbuildable(LRUPolicy):
        name = "unbuildable"

        def __init__(self, capacity: int, table: object) -> None:
            raise TypeError("cannot build")

    m = ARCOffloadingManager(CPUBackend(16, 4))
    store(m, 1, 2, 3)
    _choose(monkeypatch, Unbuildable)
    blocks, stats = _blocks(m), m.stats()
    with pytest.raises(
        PolicyFailedError, match=r"'unbuildable' could not be built \(TypeError: cannot build\)"
    ):
        m.switch_policy("unbuildable")
    assert m.policy_name == "arc" and _blocks(m) == blocks and m.stats() == stats


def test_a_failed_switch_away_from_hkvarc_leaves_its_counters_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the copy of hkvarc that takes the blocks back holds the hinted ones
    # again, which it counted as deferring them: 'deferred' went 2 -> 4 (audit)
    from kvoffload.policies.lru import LRUPolicy

    class Broken(LRUPolicy):
        name = "broken"

        def seed(self, items: object) -> None:
            raise RuntimeError("seed failed")

    m = PolicyOffloadingManager(CPUBackend(16, 4), policy="hkvarc")
    store(m, 1, 2, 3)
    m.hint(bhs(1, 2))
    _choose(monkeypatch, Broken)
    before = dict(m.stats().policy_counters)
    assert before["deferred"] == 2
    with pytest.raises(PolicyFailedError, match="failed to take over"):
        m.switch_policy("broken")
    assert dict(m.stats().policy_counters) == before
    m.hint(bhs(3))  # and it counts on from there
    assert m.stats().policy_counters["deferred"] == 3
