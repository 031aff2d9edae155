"""Immutable statistics snapshots of a manager.

The manager keeps plain integer counters that only its owning thread writes;
:meth:`~kvoffload.manager.PolicyOffloadingManager.stats` copies them into the
frozen dataclasses below, which are safe to hand to any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvoffload.event_log import EventLogStats

#: outcomes of blocks named in ``prepare_store`` / ``complete_store``
STORE_OUTCOMES = ("stored", "skipped_present", "failed", "rejected_no_room")


@dataclass(frozen=True, slots=True)
class ManagerCounters:
    """Monotonic counters since the manager was created (a policy switch keeps them)."""

    lookups: int
    lookup_blocks: int
    hit_blocks: int
    load_blocks: int
    load_completed_blocks: int
    touches: int
    store_prepared_blocks: int
    #: blocks by outcome, keys = :data:`STORE_OUTCOMES`
    store_blocks: Mapping[str, int]
    rejected_stores: int
    #: evicted blocks by list the victim came from (``lru``, ``t1``, ``t2``...)
    evictions: Mapping[str, int]
    #: touches that hit a ghost list, by list (``b1``, ``b2``)
    ghost_hits: Mapping[str, int]
    policy_switches: int


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A consistent picture of a manager at one instant."""

    policy: str
    medium: str
    block_size: int
    capacity: int
    used: int
    free: int
    #: resident blocks with ref_cnt > 0 (being loaded)
    pinned: int
    #: blocks with ref_cnt == -1 (store in flight, not readable)
    in_flight: int
    #: sizes of the policy's lists, e.g. {"lru": n} or {"t1":..,"t2":..,"b1":..,"b2":..}
    lists: Mapping[str, int]
    #: the policy's adaptive parameters, e.g. {"target_t1_size": 12.0}
    params: Mapping[str, float]
    counters: ManagerCounters
    events: EventLogStats | None

    @property
    def target_t1_size(self) -> float | None:
        """ARC's target size of T1, ``None`` for policies without one."""
        return self.params.get("target_t1_size")

    @property
    def hit_ratio(self) -> float:
        """Blocks found by lookups / blocks asked for, since creation (0.0 if none)."""
        c = self.counters
        return c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0
