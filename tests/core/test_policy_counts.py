"""A policy's own counts (``ManagerStats.policy_counters``) never go down:
switching away and back adds to what the policy had counted before."""

from __future__ import annotations

from kvoffload import CPUBackend, PolicyOffloadingManager

from .fakes import bhs, store


def test_policy_counts_are_summed_over_every_time_it_was_the_policy() -> None:
    m = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=4), policy="hkvarc")
    store(m, 1, 2, 3, 4)
    ticket = m.hint(bhs(1, 2))  # two resident blocks taken out of kvarc's order
    first = dict(m.stats().policy_counters)
    assert first["deferred"] == 2
    m.switch_policy("lru")
    assert m.stats().policy_counters == {}
    m.switch_policy("hkvarc")  # holds the two hinted blocks again
    again = dict(m.stats().policy_counters)
    assert again["deferred"] == first["deferred"] + 2
    assert all(again[k] >= n for k, n in first.items())
    m.unhint(ticket)
    assert m.stats().policy_counters["deferred"] == again["deferred"]
