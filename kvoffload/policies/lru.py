"""Least-recently-used eviction (vLLM's ``LRUOffloadingManager`` order)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import filterfalse

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victim
from kvoffload.policies.recency import RecencyList, Taken


class LRUPolicy(EvictionPolicy):
    """One list in recency order; the least recently used evictable block goes.

    A pinned block that an eviction passes is parked until the manager
    reports it released; it then comes back as the most recently used (it
    was in use until then). See :mod:`kvoffload.policies.recency`.
    """

    name = "lru"
    list_names = ("lru",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.blocks = RecencyList()
        self.evictions = {"lru": 0}
        # busy blocks are never parked unless pinned: for any other block
        # the main table is the answer, straight from the C method
        self.get_idle = self.blocks.order.get  # type: ignore[method-assign,assignment]

    def get(self, block_hash: BlockHash) -> Handle | None:
        return self.blocks.get(block_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[Handle | None]:
        lst = self.blocks
        blocks = list(map(lst.order.get, block_hashes))
        if lst.parked and None in blocks:
            get = lst.parked.get
            return [
                b if b is not None else get(h) for h, b in zip(block_hashes, blocks, strict=True)
            ]
        return blocks

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        lst = self.blocks
        missing = filterfalse(lst.order.__contains__, block_hashes)
        if lst.parked:
            missing = filterfalse(lst.parked.__contains__, missing)
        return list(missing)

    def __len__(self) -> int:
        return len(self.blocks)

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        self.blocks.order.update(zip(block_hashes, blocks, strict=True))

    def remove(self, block_hash: BlockHash) -> Handle | None:
        return self.blocks.remove(block_hash)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        od = self.blocks.order
        move = od.move_to_end
        for h in reversed(block_hashes):
            if h in od:
                move(h)

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        lst = self.blocks
        if n > len(lst.order):  # parked blocks are all busy
            return None
        taken = Taken()
        # every parked block is busy: when they are all the busy ones, the
        # list holds none and the scan need not look
        busy = self.busy if len(self.busy) > len(lst.parked) else {}
        victims = lst.take(n, protected, busy, taken)
        if len(victims) < n:
            lst.rollback(taken)
            return None
        lst.commit(taken)
        self.evictions["lru"] += n
        return victims

    def stored(self, block_hashes: Sequence[BlockHash]) -> None:
        return  # blocks in flight are never parked (RecencyList moves them)

    def released(self, block_hashes: Sequence[BlockHash]) -> None:
        self.blocks.release(block_hashes)

    def ordered_items(self) -> Iterator[tuple[BlockHash, Handle]]:
        # parked blocks are in use: they count as the most recent
        return iter(self.blocks.entries())

    def list_sizes(self) -> dict[str, int]:
        return {"lru": len(self.blocks)}
