"""Least-recently-used eviction (vLLM's ``LRUOffloadingManager`` order)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence

from kvoffload.abstract import BlockHash
from kvoffload.backend import BlockStatus
from kvoffload.policies.base import EvictionPolicy, Victim


def take_evictable(
    items: Iterator[tuple[BlockHash, BlockStatus]],
    n: int,
    protected: Container[BlockHash],
    list_name: str,
    victims: list[Victim],
    passed: list[BlockHash],
) -> int:
    """Move up to ``n`` evictable entries of ``items`` (oldest first) to
    ``victims`` and return how many; record the non-evictable ones passed on
    the way in ``passed``. ``items`` stops right after the last victim, so a
    later call continues the same scan."""
    if n <= 0:
        return 0
    got = 0
    append = victims.append
    for h, b in items:
        if b.ref_cnt == 0:
            if h in protected:
                continue
            append((h, b, list_name))
            got += 1
            if got == n:
                break
        else:
            passed.append(h)
    return got


class LRUPolicy(EvictionPolicy):
    """One list in recency order; the least recently used evictable block goes."""

    name = "lru"
    list_names = ("lru",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.blocks: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        # bound C method: the manager's lookups call it once per block
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]

    def get(self, block_hash: BlockHash) -> BlockStatus | None:  # replaced per instance
        return self.blocks.get(block_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        od = self.blocks
        return [h for h in block_hashes if h not in od]

    def __len__(self) -> int:
        return len(self.blocks)

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        self.blocks.update(zip(block_hashes, blocks, strict=True))

    def remove(self, block_hash: BlockHash) -> BlockStatus | None:
        return self.blocks.pop(block_hash, None)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        od = self.blocks
        move = od.move_to_end
        for h in reversed(block_hashes):
            if h in od:
                move(h)

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        victims: list[Victim] = []
        passed: list[BlockHash] = []
        od = self.blocks
        take_evictable(iter(od.items()), n, protected, "lru", victims, passed)
        if len(victims) < n:
            return None
        for h, _, _ in victims:
            del od[h]
        move = od.move_to_end
        for h in passed:
            move(h)
        return victims

    def ordered_items(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        return iter(list(self.blocks.items()))

    def list_sizes(self) -> dict[str, int]:
        return {"lru": len(self.blocks)}
