"""Least-recently-used eviction (vLLM's ``LRUOffloadingManager`` order)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victims
from kvoffload.table import BlockTable

LRU = 0  # the table tag of the one list


class LRUPolicy(EvictionPolicy):
    """One list in recency order; the least recently used evictable block goes.

    A busy block (pinned, or its store in flight) that an eviction passes
    keeps its place, as in vLLM; later evictions skip it until it is ready.
    """

    name = "lru"
    list_names = ("lru",)
    resident_tags = (LRU,)

    def __init__(self, capacity: int, table: BlockTable) -> None:
        super().__init__(capacity, table)
        self.evictions = {"lru": 0}
        # the table's touch (with its default rules) is LRU's: no Python frame
        self.touch = table.touch  # type: ignore[method-assign,assignment]

    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        # the table's default touch rules are LRU's
        self.table.relist([h for h, _ in items], LRU)

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        self.table.insert(block_hashes, blocks, LRU)

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        picked = self.table.evict(LRU, -1, n, n, protected)
        if picked is None:
            return None
        self.evictions["lru"] += n
        return picked[0], picked[1]

    def list_sizes(self) -> dict[str, int]:
        return {"lru": len(self.table)}
