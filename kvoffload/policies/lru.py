"""Least-recently-used eviction (vLLM's ``LRUOffloadingManager`` order)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import compress, filterfalse, repeat
from operator import attrgetter, itemgetter, not_

from kvoffload.abstract import BlockHash
from kvoffload.backend import BlockStatus
from kvoffload.policies.base import EvictionPolicy, Victim

_HASH = itemgetter(0)
_BLOCK = itemgetter(1)
_REF_CNT = attrgetter("ref_cnt")


def all_evictable(entries: list[Victim], protected: Container[BlockHash]) -> bool:
    """Whether every entry is unpinned, ready and not protected (C-level
    filters, no Python step per block)."""
    return not (
        any(map(_REF_CNT, map(_BLOCK, entries)))
        or any(map(protected.__contains__, map(_HASH, entries)))
    )


def pop_oldest(
    od: OrderedDict[BlockHash, BlockStatus],
    n: int,
    protected: Container[BlockHash],
    parked: dict[BlockHash, BlockStatus],
) -> list[Victim] | None:
    """Remove and return the ``n`` oldest evictable entries of ``od`` not in
    ``protected``, or ``None`` with ``od`` unchanged.

    Pinned and in-flight entries met on the way move from ``od`` to
    ``parked`` (they are in use; the policy returns them as most recent when
    they are released), so no later eviction passes them again: O(1)
    amortised per victim however many blocks are busy. Protected entries
    stay at the front, in order. Entries are taken in batches and sorted
    with C-level filters: no Python step per block."""
    if n > len(od):
        return None
    pop = od.popitem
    contains = protected.__contains__
    victims: list[Victim] = []
    seen: list[Victim] = []  # every entry taken, in order
    busy: list[Victim] = []
    skipped: list[Victim] = []  # protected
    while (need := n - len(victims)) and od:
        batch = list(map(pop, repeat(False, min(need, len(od)))))
        seen += batch
        refs = list(map(_REF_CNT, map(_BLOCK, batch)))
        if any(refs):
            busy += compress(batch, refs)
            batch = list(compress(batch, map(not_, refs)))
        named = list(map(contains, map(_HASH, batch)))
        if any(named):
            skipped += compress(batch, named)
            batch = list(compress(batch, map(not_, named)))
        victims += batch
    if len(victims) < n:  # put everything back as it was
        push_front(od, seen)
        return None
    parked.update(busy)
    push_front(od, skipped)
    return victims


def push_front(od: OrderedDict[BlockHash, BlockStatus], items: list[Victim]) -> None:
    """Put ``items`` (oldest first) back at the oldest end of ``od``."""
    to_front = od.move_to_end
    for h, b in reversed(items):
        od[h] = b
        to_front(h, last=False)


class LRUPolicy(EvictionPolicy):
    """One list in recency order; the least recently used evictable block goes.

    A pinned or in-flight block that an eviction passes is *parked* outside
    the list until the manager reports it released; it then comes back as
    the most recently used (it was in use until then).
    """

    name = "lru"
    list_names = ("lru",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.blocks: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        self.parked: dict[BlockHash, BlockStatus] = {}
        self.evictions = {"lru": 0}
        self._unpark_get()

    def _unpark_get(self) -> None:
        # With nothing parked, lookups go straight to the C method (the
        # manager calls it once per block).
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]

    def get(self, block_hash: BlockHash) -> BlockStatus | None:
        b = self.blocks.get(block_hash)
        return b if b is not None else self.parked.get(block_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks or block_hash in self.parked

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus | None]:
        blocks = list(map(self.blocks.get, block_hashes))
        if self.parked and None in blocks:
            get = self.parked.get
            return [
                b if b is not None else get(h) for h, b in zip(block_hashes, blocks, strict=True)
            ]
        return blocks

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        missing = filterfalse(self.blocks.__contains__, block_hashes)
        if self.parked:
            missing = filterfalse(self.parked.__contains__, missing)
        return list(missing)

    def __len__(self) -> int:
        return len(self.blocks) + len(self.parked)

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        self.blocks.update(zip(block_hashes, blocks, strict=True))

    def remove(self, block_hash: BlockHash) -> BlockStatus | None:
        b = self.blocks.pop(block_hash, None)
        if b is None and self.parked:
            b = self.parked.pop(block_hash, None)
            if not self.parked:
                self._unpark_get()
        return b

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        od = self.blocks
        move = od.move_to_end
        for h in reversed(block_hashes):
            if h in od:
                move(h)

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        parked = self.parked
        had_parked = bool(parked)
        victims = pop_oldest(self.blocks, n, protected, parked)
        if parked and not had_parked:
            self.get = self._get_parked  # type: ignore[method-assign]
        if victims is not None:
            self.evictions["lru"] += n
        return victims

    _get_parked = get

    def released(self, block_hashes: Sequence[BlockHash]) -> None:
        parked = self.parked
        if not parked:
            return
        od = self.blocks
        pop = parked.pop
        for h in filter(parked.__contains__, block_hashes):
            od[h] = pop(h)
        if not parked:
            self._unpark_get()

    def ordered_items(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        # parked blocks are in use: they count as the most recent
        return iter([*self.blocks.items(), *self.parked.items()])

    def list_sizes(self) -> dict[str, int]:
        return {"lru": len(self)}
