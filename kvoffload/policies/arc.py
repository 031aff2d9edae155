"""Adaptive Replacement Cache (Megiddo & Modha), as vLLM 0.11.2 adapts it.

T1 holds blocks used once, T2 blocks used at least twice, B1/B2 remember the
hashes recently evicted from T1/T2 (ghosts). A touch that hits B1 says "T1
was too small": ``target_t1_size`` grows by ``max(1, |B2|/|B1|)``; a B2 hit
shrinks it by ``max(1, |B1|/|B2|)``. Eviction takes T1's oldest evictable
block while ``len(T1) >= int(target_t1_size)``, else T2's, falling back to
the other list when the preferred one has nothing evictable.

T1 and T2 are :class:`~kvoffload.policies.recency.RecencyList` s: a pinned
block an eviction passes is parked at its list's recent end until released
(a parked T1 block that is touched while pinned moves to T2's); a block
whose store is in flight moves to its list's recent end.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, MutableMapping, Sequence
from itertools import filterfalse, repeat
from operator import itemgetter
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victim
from kvoffload.policies.recency import RecencyList, take_from_two

_HASH = itemgetter(0)


class TwoListPolicy(EvictionPolicy):
    """What ARC and its variants share: resident blocks in T1 and T2 (each a
    :class:`~kvoffload.policies.recency.RecencyList`), ghosts in B1 and B2
    and an adaptive target size for T1. A subclass chooses the ghost tables,
    where stored blocks enter, what a touch does and what is evicted."""

    list_names = ("t1", "t2", "b1", "b2")
    #: where ``target_t1_size`` starts, and returns to when ghosts are
    #: cleared, as a share of the capacity
    initial_target_share: ClassVar[float] = 0.0
    #: hashes evicted from T1 / T2, oldest first (set by the subclass)
    b1: MutableMapping[BlockHash, None]
    b2: MutableMapping[BlockHash, None]

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1 = RecencyList()
        self.t2 = RecencyList()
        self.target_t1_size: float = capacity * self.initial_target_share
        self.ghost_hits = {"b1": 0, "b2": 0}
        self.evictions = {"t1": 0, "t2": 0}
        self._get1, self._get2 = self.t1.order.get, self.t2.order.get

    def get(self, block_hash: BlockHash) -> Handle | None:
        b = self._get1(block_hash)
        if b is None:
            b = self._get2(block_hash)
            if b is None and (self.t1.parked or self.t2.parked):
                b = self.t1.parked.get(block_hash)
                if b is None:
                    b = self.t2.parked.get(block_hash)
        return b

    get_idle = get

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.t1 or block_hash in self.t2

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        missing = filterfalse(self.t2.order.__contains__, block_hashes)
        missing = filterfalse(self.t1.order.__contains__, missing)
        for parked in (self.t1.parked, self.t2.parked):
            if parked:
                missing = filterfalse(parked.__contains__, missing)
        return list(missing)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def remove(self, block_hash: BlockHash) -> Handle | None:
        b = self.t1.remove(block_hash)
        return b if b is not None else self.t2.remove(block_hash)

    def stored(self, block_hashes: Sequence[BlockHash]) -> None:
        return  # blocks in flight are never parked (RecencyList moves them)

    def released(self, block_hashes: Sequence[BlockHash]) -> None:
        self.t1.release(block_hashes)
        self.t2.release(block_hashes)

    def ordered_items(self) -> Iterator[tuple[BlockHash, Handle]]:
        return iter([*self.t1.entries(), *self.t2.entries()])

    def seed(self, items: Iterable[tuple[BlockHash, Handle]]) -> None:
        # Another policy's order seeds T1 (no block has a proven second use
        # yet from this policy's point of view); ghosts start empty.
        self.t1.order.update(items)

    def list_sizes(self) -> dict[str, int]:
        return {"t1": len(self.t1), "t2": len(self.t2), "b1": len(self.b1), "b2": len(self.b2)}

    def params(self) -> dict[str, float]:
        return {"target_t1_size": float(self.target_t1_size)}

    def clear_ghosts(self) -> None:
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = self.capacity * self.initial_target_share  # learnt from them


class ARCPolicy(TwoListPolicy):
    """ARC over resident blocks; ghost lists bounded by the capacity."""

    name = "arc"
    b1: OrderedDict[BlockHash, None]
    b2: OrderedDict[BlockHash, None]

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.b1 = OrderedDict()
        self.b2 = OrderedDict()

    @property
    def cache_capacity(self) -> int:
        """vLLM's name for the capacity (bound of T1+T2 and of each ghost list)."""
        return self.capacity

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        self.t1.order.update(zip(block_hashes, blocks, strict=True))
        for ghosts in (self.b1, self.b2):  # re-stored: no longer a ghost
            if ghosts:
                deque(map(ghosts.pop, block_hashes, repeat(None)), 0)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        t1, t2 = self.t1.order, self.t2.order
        p1, p2 = self.t1.parked, self.t2.parked
        b1, b2 = self.b1, self.b2
        busy = self.busy
        # Most touched hashes are in no list (a new prompt's blocks): one
        # pass of membership tests drops them before the per-list work.
        rev = reversed(block_hashes)
        if p1 or p2:
            known = [
                h for h in rev if h in t1 or h in t2 or h in b1 or h in b2 or h in p1 or h in p2
            ]
        else:
            known = [h for h in rev if h in t1 or h in t2 or h in b1 or h in b2]
        for h in known:
            b = t1.get(h)
            if b is not None:
                if busy.get(h, 0) < 0:
                    # Store still in flight: the engine touches right after
                    # prepare_store, which is not a second use. Stay in T1.
                    t1.move_to_end(h)
                else:
                    del t1[h]
                    t2[h] = b
            elif h in t2:
                t2.move_to_end(h)
            elif h in p1:  # parked: pinned by a load, so a second use
                p2[h] = p1.pop(h)
            elif h in p2:
                pass  # in use: back at T2's recent end when released
            elif h in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + delta, self.capacity)
                b1.move_to_end(h)
                self.ghost_hits["b1"] += 1
            elif h in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0.0)
                b2.move_to_end(h)
                self.ghost_hits["b2"] += 1

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        # T1 is preferred while len(T1) >= int(target), and each T1 victim
        # shrinks it, so the picks come in at most three runs: T1 until it
        # drops below the target, then T2, then T1 again (each list falling
        # back to the other when it has nothing evictable). Every run resumes
        # where its list's previous one stopped: one pass per list for the
        # whole batch (vLLM restarts the scan for every victim).
        t1 = self.t1
        first = min(n, max(0, len(t1) - int(self.target_t1_size) + 1))
        picked = take_from_two(t1, self.t2, first, n, protected, self.busy)
        if picked is None:
            return None
        v1, v2 = picked
        cap = self.capacity
        for ghosts, victims, name in ((self.b1, v1, "t1"), (self.b2, v2, "t2")):
            if victims:
                ghosts.update(dict.fromkeys(map(_HASH, victims)))
                if len(ghosts) > cap:
                    deque(map(ghosts.popitem, repeat(False, len(ghosts) - cap)), 0)
                self.evictions[name] += len(victims)
        return v1 + v2 if v2 else v1
