"""Least-recently-used eviction (vLLM's ``LRUOffloadingManager`` order)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from enum import IntEnum

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victims

__all__ = ["LRU", "LRUList", "LRUPolicy"]


class LRUList(IntEnum):
    LRU = 0  # the one list, least recently used first


LRU = int(LRUList.LRU)  # a plain int is quicker to pass to the table


class LRUPolicy(EvictionPolicy):
    """One list in recency order; the least recently used evictable block
    goes. A touch moves a block to the most recent end (the default touch
    rules). A busy block an eviction passes keeps its place, as in vLLM."""

    name = "lru"
    lists = LRUList

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        self.table.insert(block_hashes, blocks, LRU)

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        return self.evict_from(LRU, n, protected)
