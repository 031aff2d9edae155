"""Adaptive Replacement Cache (Megiddo & Modha), as vLLM 0.11.2 adapts it.

T1 holds blocks used once, T2 blocks used at least twice, B1/B2 remember the
hashes recently evicted from T1/T2 (ghosts). A touch that hits B1 says "T1
was too small": ``target_t1_size`` grows by ``max(1, |B2|/|B1|)``; a B2 hit
shrinks it by ``max(1, |B1|/|B2|)``. Eviction takes T1's oldest evictable
block while ``len(T1) >= int(target_t1_size)``, else T2's, falling back to
the other list when the preferred one has nothing evictable.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import repeat

from kvoffload.abstract import BlockHash
from kvoffload.backend import BlockStatus
from kvoffload.policies.base import EvictionPolicy, Victim
from kvoffload.policies.lru import _HASH, all_evictable, push_front


def _take_evictable(
    items: Iterator[tuple[BlockHash, BlockStatus]],
    n: int,
    protected: Container[BlockHash],
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
    for item in items:
        if item[1].ref_cnt == 0:
            if item[0] in protected:
                continue
            append(item)
            got += 1
            if got == n:
                break
        else:
            passed.append(item[0])
    return got


class ARCPolicy(EvictionPolicy):
    """ARC over resident blocks; ghost lists bounded by the capacity."""

    name = "arc"
    list_names = ("t1", "t2", "b1", "b2")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[BlockHash, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()
        self.ghost_hits = {"b1": 0, "b2": 0}
        self.evictions = {"t1": 0, "t2": 0}
        # Lists ("t1", "t2") whose last scan found every block pinned or in
        # flight; evict skips them until one of their blocks can be evicted
        # again (released(), or a promotion into T2). Without this, a busy
        # preferred list is scanned in full by every eviction.
        self._busy: set[str] = set()

    @property
    def cache_capacity(self) -> int:
        """vLLM's name for the capacity (bound of T1+T2 and of each ghost list)."""
        return self.capacity

    def get(self, block_hash: BlockHash) -> BlockStatus | None:
        b = self.t1.get(block_hash)
        return b if b is not None else self.t2.get(block_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.t1 or block_hash in self.t2

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[BlockStatus | None]:
        t1_get, t2_get = self.t1.get, self.t2.get
        return [b if (b := t1_get(h)) is not None else t2_get(h) for h in block_hashes]

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        t1, t2 = self.t1, self.t2
        return [h for h in block_hashes if h not in t1 and h not in t2]

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        self.t1.update(zip(block_hashes, blocks, strict=True))
        for ghosts in (self.b1, self.b2):  # re-stored: no longer a ghost
            if ghosts:
                deque(map(ghosts.pop, block_hashes, repeat(None)), 0)
        if "t1" in self._busy and any(b.ref_cnt == 0 for b in blocks):
            self._busy.discard("t1")

    def remove(self, block_hash: BlockHash) -> BlockStatus | None:
        b = self.t1.pop(block_hash, None)
        return b if b is not None else self.t2.pop(block_hash, None)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        busy = self._busy
        # Most touched hashes are in no list (a new prompt's blocks): one
        # pass of membership tests drops them before the per-list work.
        known = [h for h in reversed(block_hashes) if h in t1 or h in t2 or h in b1 or h in b2]
        for h in known:
            b = t1.get(h)
            if b is not None:
                if b.ref_cnt < 0:
                    # Store still in flight: the engine touches right after
                    # prepare_store, which is not a second use. Stay in T1.
                    t1.move_to_end(h)
                else:
                    del t1[h]
                    t2[h] = b
                    if busy and b.ref_cnt == 0:
                        busy.discard("t2")
            elif h in t2:
                t2.move_to_end(h)
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
        # shrinks it: the picks are T1's oldest until it drops below the
        # target, then T2's, then T1's again, each list falling back to the
        # other when it has nothing evictable.
        t1, t2 = self.t1, self.t2
        first = min(n, len(t1), max(0, len(t1) - int(self.target_t1_size) + 1))
        if n - first <= len(t2):
            # The common case, without a Python step per block: the oldest
            # `first` of T1 and `n - first` of T2 are all evictable.
            v1 = list(map(t1.popitem, repeat(False, first)))
            v2 = list(map(t2.popitem, repeat(False, n - first)))
            if all_evictable(v1, protected) and all_evictable(v2, protected):
                return self._evicted(v1, v2)
            push_front(t1, v1)
            push_front(t2, v2)
        return self._scan(n, first, protected)

    def _scan(self, n: int, first: int, protected: Container[BlockHash]) -> list[Victim] | None:
        # Every run resumes its list's iterator: one pass per list for the
        # whole batch (vLLM restarts the scan for every victim: O(n *
        # pinned)). Selection first, mutation after, so that a failed batch
        # changes nothing.
        t1, t2 = self.t1, self.t2
        busy = self._busy
        skip1, skip2 = "t1" in busy, "t2" in busy
        it1 = iter(t1.items())
        it2 = iter(t2.items())
        v1: list[Victim] = []
        v2: list[Victim] = []
        passed1: list[BlockHash] = []
        passed2: list[BlockHash] = []
        got1 = 0 if skip1 else _take_evictable(it1, first, protected, v1, passed1)
        done1 = skip1 or got1 < first  # T1 has nothing more to give
        rest = n - got1
        got2 = 0 if skip2 else _take_evictable(it2, rest, protected, v2, passed2)
        done2 = skip2 or got2 < rest
        rest -= got2
        if rest and not done1:  # fall back to T1
            more = _take_evictable(it1, rest, protected, v1, passed1)
            done1 = more < rest
            got1 += more
            rest -= more
        # A list scanned to its end holds victims, passed (busy) blocks and
        # protected ones; with no protected ones, what stays is all busy.
        ok = not rest
        if done1 and not skip1 and len(t1) == got1 + len(passed1) and (ok or not got1):
            busy.add("t1")
        if done2 and not skip2 and len(t2) == got2 + len(passed2) and (ok or not got2):
            busy.add("t2")
        if not ok:
            return None
        deque(map(t1.__delitem__, map(_HASH, v1)), 0)
        deque(map(t2.__delitem__, map(_HASH, v2)), 0)
        for od, passed in ((t1, passed1), (t2, passed2)):
            deque(map(od.move_to_end, passed), 0)
        return self._evicted(v1, v2)

    def _evicted(self, v1: list[Victim], v2: list[Victim]) -> list[Victim]:
        """Book victims already removed from T1 (``v1``) and T2 (``v2``):
        ghosts, bounded ghost lists, counts."""
        b1, b2 = self.b1, self.b2
        cap = self.capacity
        for ghosts, victims, name in ((b1, v1, "t1"), (b2, v2, "t2")):
            if victims:
                ghosts.update(dict.fromkeys(map(_HASH, victims)))
                if len(ghosts) > cap:
                    deque(map(ghosts.popitem, repeat(False, len(ghosts) - cap)), 0)
                self.evictions[name] += len(victims)
        return v1 + v2 if v2 else v1

    def released(self, block_hashes: Sequence[BlockHash]) -> None:
        busy = self._busy
        if not busy:
            return
        t1 = self.t1
        for h in block_hashes:
            busy.discard("t1" if h in t1 else "t2")
            if not busy:
                return

    def ordered_items(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        return iter([*self.t1.items(), *self.t2.items()])

    def seed(self, items: object) -> None:
        # Another policy's order seeds T1 (no block has a proven second use
        # yet from ARC's point of view); ghosts start empty, target at 0.
        self.t1.update(items)  # type: ignore[call-overload]
        self._busy.clear()

    def list_sizes(self) -> dict[str, int]:
        return {"t1": len(self.t1), "t2": len(self.t2), "b1": len(self.b1), "b2": len(self.b2)}

    def params(self) -> dict[str, float]:
        return {"target_t1_size": float(self.target_t1_size)}

    def clear_ghosts(self) -> None:
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0
