"""Immutable statistics snapshots of a manager.

The manager keeps plain integer counters that only its owning thread writes;
:meth:`~kvoffload.manager.PolicyOffloadingManager.stats` copies them into the
frozen dataclasses below, which are safe to hand to any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvoffload.event_log import EventLogStats

__all__ = ["ARC_LISTS", "STORE_OUTCOMES", "ManagerCounters", "ManagerStats", "WindowStats"]

#: outcomes of blocks named in ``prepare_store`` / ``complete_store``
STORE_OUTCOMES = ("stored", "skipped_present", "failed", "rejected_no_room")
#: the lists of the ARC family (``arc``, ``kvarc``, ``hkvarc``): resident T1, T2; ghosts B1, B2
ARC_LISTS = ("t1", "t2", "b1", "b2")


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
    #: ghost-list hits, by list (``b1``, ``b2``): touches for ARC, re-stores for kvarc
    ghost_hits: Mapping[str, int]
    policy_switches: int


@dataclass(frozen=True, slots=True)
class WindowStats:
    """The hint window: the waiting requests a manager was told about with
    ``hint`` and that have not been unhinted yet (whatever the policy)."""

    #: requests in the window (tickets not yet unhinted)
    requests: int
    #: block hashes those requests will use, repeats counted
    uses: int
    #: distinct block hashes with a use in the window
    blocks: int
    #: of those, the ones resident (offloaded, stores in flight included)
    resident: int


#: the window of a manager nobody hinted
_EMPTY_WINDOW = WindowStats(requests=0, uses=0, blocks=0, resident=0)


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
    #: which of ``lists`` are ghost lists (hashes of evicted blocks, no data)
    ghost_list_names: frozenset[str] = frozenset()
    #: the hint window (kept by the manager whatever the policy)
    window: WindowStats = _EMPTY_WINDOW
    #: the current policy's own counts since the manager was made, summed
    #: over every time it was the policy (e.g. hkvarc's ``redirected``), so
    #: they never go down; empty for lru, arc, kvarc
    policy_counters: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def resident_lists(self) -> dict[str, int]:
        """Sizes of the lists holding resident blocks (they sum to ``used``)."""
        return {k: v for k, v in self.lists.items() if k not in self.ghost_list_names}

    @property
    def ghost_lists(self) -> dict[str, int]:
        """Entries of each ghost list (remembered hashes of evicted blocks)."""
        return {k: v for k, v in self.lists.items() if k in self.ghost_list_names}

    @property
    def target_t1_size(self) -> float | None:
        """The ARC family's target size of T1, ``None`` for policies without one."""
        return self.params.get("target_t1_size")

    @property
    def arc_lists(self) -> dict[str, int] | None:
        """The sizes of :data:`ARC_LISTS`, ``None`` unless the policy keeps
        all four (``arc``, ``kvarc``, ``hkvarc``; hkvarc's ``t1``/``t2`` leave
        out its held blocks, which it reports as ``h1``/``h2``)."""
        if not all(name in self.lists for name in ARC_LISTS):
            return None
        return {name: self.lists[name] for name in ARC_LISTS}

    @property
    def hit_ratio(self) -> float:
        """Blocks found by lookups / blocks asked for, since creation (0.0 if none)."""
        c = self.counters
        return c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0
