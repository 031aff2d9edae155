"""Adaptive Replacement Cache (Megiddo & Modha), as vLLM 0.11.2 adapts it.

T1 holds blocks used once, T2 blocks used at least twice, B1/B2 remember the
hashes recently evicted from T1/T2 (ghosts). A touch that hits B1 says "T1
was too small": ``target_t1_size`` grows by ``max(1, |B2|/|B1|)``; a B2 hit
shrinks it by ``max(1, |B1|/|B2|)``. Eviction takes T1's oldest evictable
block while ``len(T1) >= int(target_t1_size)``, else T2's, falling back to
the other list when the preferred one has nothing evictable.

T1 and T2 are lists of the manager's :class:`~kvoffload.table.BlockTable`
(tags 0 and 1), B1 and B2 its ghost lists (tags 4 and 5). A busy block an
eviction passes keeps its place in its list, as in vLLM, and later
evictions skip it until it is ready again.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victims
from kvoffload.table import BlockTable, TableList

#: table tags: resident lists T1, T2 and ghost lists B1, B2
T1, T2, B1, B2 = 0, 1, 4, 5


class TwoListPolicy(EvictionPolicy):
    """What ARC and its variants share: resident blocks in T1 and T2, ghosts
    in B1 and B2 (table lists, exposed as read-only mappings) and an
    adaptive target size for T1. A subclass chooses the touch rules, where
    stored blocks enter and what is evicted."""

    list_names = ("t1", "t2", "b1", "b2")
    resident_tags = (T1, T2)
    #: where ``target_t1_size`` starts, and returns to when ghosts are
    #: cleared, as a share of the capacity
    initial_target_share: ClassVar[float] = 0.0

    def __init__(self, capacity: int, table: BlockTable) -> None:
        super().__init__(capacity, table)
        self.t1 = TableList(table, T1)
        self.t2 = TableList(table, T2)
        self.b1 = TableList(table, B1)
        self.b2 = TableList(table, B2)
        self.target_t1_size: float = capacity * self.initial_target_share
        self.ghost_hits = {"b1": 0, "b2": 0}
        self.evictions = {"t1": 0, "t2": 0}

    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        # Another policy's order seeds T1 (no block has a proven second use
        # yet from this policy's point of view); ghosts start empty.
        self.table.relist([h for h, _ in items], T1)

    def _evict(
        self, n: int, protected: Container[BlockHash], first: int
    ) -> tuple[Victims, int, int] | None:
        """Up to ``first`` victims from T1, then T2, then T1 again; the
        victims become ghosts. Also returns how many came from each list."""
        picked = self.table.evict(T1, T2, first, n, protected, B1, B2)
        if picked is None:
            return None
        hashes, handles, n1 = picked
        self.evictions["t1"] += n1
        self.evictions["t2"] += n - n1
        return (hashes, handles), n1, n - n1

    def list_sizes(self) -> dict[str, int]:
        size = self.table.size
        return {"t1": size(T1), "t2": size(T2), "b1": size(B1), "b2": size(B2)}

    def params(self) -> dict[str, float]:
        return {"target_t1_size": float(self.target_t1_size)}

    def clear_ghosts(self) -> None:
        self.table.clear_tag(B1)
        self.table.clear_tag(B2)
        self.target_t1_size = self.capacity * self.initial_target_share  # learnt from them


class ARCPolicy(TwoListPolicy):
    """ARC over resident blocks; ghost lists bounded by the capacity."""

    name = "arc"

    @property
    def cache_capacity(self) -> int:
        """vLLM's name for the capacity (bound of T1+T2 and of each ghost list)."""
        return self.capacity

    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        # A used-again T1 block moves to T2, except while its store is in
        # flight (the engine touches right after prepare_store, which is not
        # a second use): it stays in T1, most recent. Ghost hits are reported.
        self.table.set_touch_rules((T2, T2, 2, 3), (T1, T2, 2, 3), True)
        super().seed(items)

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
        picked = self._evict(n, protected, first)
        if picked is None:
            return None
        victims, n1, n2 = picked
        cap = self.capacity
        if n1:
            self.table.trim(B1, cap)
        if n2:
            self.table.trim(B2, cap)
        return victims
