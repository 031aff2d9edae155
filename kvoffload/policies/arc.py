"""Adaptive Replacement Cache (Megiddo & Modha), as vLLM 0.11.2 adapts it.

T1 holds blocks used once, T2 blocks used at least twice, B1/B2 remember the
hashes recently evicted from T1/T2 (ghosts). A touch that hits B1 says "T1
was too small": ``target_t1_size`` grows by ``max(1, |B2|/|B1|)``; a B2 hit
shrinks it by ``max(1, |B1|/|B2|)``. Eviction takes T1's oldest evictable
block while ``len(T1) >= int(target_t1_size)``, else T2's, falling back to
the other list when the preferred one has nothing evictable.

T1 and T2 are lists of the manager's :class:`~kvoffload.table.BlockTable`,
B1 and B2 its ghost lists (:class:`ARCList` names them). A busy block an
eviction passes keeps its place in its list, as in vLLM, and later
evictions skip it until it is ready again.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from enum import IntEnum
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victims
from kvoffload.table import BlockTable, TableList, TouchRules

__all__ = ["B1", "B2", "T1", "T2", "ARCList", "ARCPolicy", "TwoListPolicy"]


class ARCList(IntEnum):
    """The lists of ARC and its variants, as block-table tags."""

    T1 = 0  # resident, used once
    T2 = 1  # resident, used again
    B1 = 4  # ghosts of blocks evicted from T1
    B2 = 5  # ghosts of blocks evicted from T2


# plain ints for the hot paths: an IntEnum member compares with the table's
# ints several times slower than an int does (list.count, ==, in)
T1, T2, B1, B2 = int(ARCList.T1), int(ARCList.T2), int(ARCList.B1), int(ARCList.B2)


class TwoListPolicy(EvictionPolicy):
    """What ARC and its variants share: resident blocks in T1 and T2, ghosts
    in B1 and B2 (exposed as read-only mappings, oldest first) and an
    adaptive target size for T1. A subclass chooses the touch rules, where
    stored blocks enter and what is evicted. Blocks taken over from another
    policy enter T1 (none has a proven second use from this policy's point
    of view yet)."""

    lists = ARCList
    #: where ``target_t1_size`` starts, and returns to when ghosts are
    #: cleared, as a share of the capacity
    initial_target_share: ClassVar[float] = 0.0

    def __init__(self, capacity: int, table: BlockTable) -> None:
        super().__init__(capacity, table)
        self.t1, self.t2, self.b1, self.b2 = (TableList(table, tag) for tag in ARCList)
        self.target_t1_size: float = capacity * self.initial_target_share

    def _evict(self, n: int, protected: Container[BlockHash], first: int) -> Victims | None:
        """Up to ``first`` victims from T1, then T2, then T1 again; the
        victims become ghosts."""
        return self.evict_from(T1, n, protected, b=T2, first=first, ghost_a=B1, ghost_b=B2)

    def params(self) -> dict[str, float]:
        return {"target_t1_size": float(self.target_t1_size)}

    def clear_ghosts(self) -> None:
        super().clear_ghosts()
        self.target_t1_size = self.capacity * self.initial_target_share  # learnt from them


class ARCPolicy(TwoListPolicy):
    """ARC over resident blocks; ghost lists bounded by the capacity."""

    name = "arc"
    # A used-again T1 block moves to T2; one whose store is in flight (the
    # engine touches right after prepare_store, which is not a second use)
    # stays in T1, most recent. Ghost hits are reported.
    touch_rules = TouchRules(ready={T1: T2}, ghosts=True)

    @property
    def cache_capacity(self) -> int:
        """vLLM's name for the capacity (bound of T1+T2 and of each ghost list)."""
        return self.capacity

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        self.table.insert(block_hashes, blocks, T1)  # a ghost re-stored stops being one

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        hits = self.table.touch(block_hashes)
        if hits:
            # a touch moves ghosts within their lists: the sizes stay put
            b1, b2 = self.table.size(B1), self.table.size(B2)
            grow = max(1.0, b2 / b1) if b1 else 0.0
            shrink = max(1.0, b1 / b2) if b2 else 0.0
            cap, target = self.capacity, self.target_t1_size
            for tag in hits:  # in order: the bounds make the steps not commute
                target = min(target + grow, cap) if tag == B1 else max(target - shrink, 0.0)
            self.target_t1_size = target
            n1 = hits.count(B1)
            self.ghost_hits["b1"] += n1
            self.ghost_hits["b2"] += len(hits) - n1

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        # T1 is preferred while len(T1) >= int(target), and each T1 victim
        # shrinks it, so the picks come in at most three runs: T1 until it
        # drops below the target, then T2, then T1 again (each list falling
        # back to the other when it has nothing evictable). Every run resumes
        # where its list's previous one stopped: one pass per list for the
        # whole batch (vLLM restarts the scan for every victim).
        first = min(n, max(0, self.table.size(T1) - int(self.target_t1_size) + 1))
        victims = self._evict(n, protected, first)
        if victims is not None:
            self.table.trim(B1, self.capacity)
            self.table.trim(B2, self.capacity)
        return victims
