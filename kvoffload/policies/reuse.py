"""Reuse-aware eviction for chained KV blocks ("reuse").

Frequency with dynamic ageing (LFU-DA, Arlitt et al.), shaped for prefix
lookups:

* Every resident block has a priority ``H = L + f``: ``f`` counts its uses
  (touches; a touch of a store still in flight is not a use), ``L`` is the
  cache's *age*, the priority of the last victim. The victim is the lowest
  ``H``, least recently used first among equals. A block used ``f`` times
  outlives about ``f`` turnovers of the never-reused blocks, so frequency
  wins over recency only as long as it is recent enough: ``L`` rises with
  each turnover and an old count stops protecting a block that is no longer
  used (ageing without a timer).
* Frequency outlives residency: an evicted block's ``f`` stays in a ghost
  list of ``GHOST_FACTOR * capacity`` hashes, touches of ghosts still count,
  and a block stored again starts from its ghost count. A document reused at
  a distance above the cache wins its slot back at a higher priority than
  a block seen once (thrash resistance: the often-reused chains stay, the
  seen-once ones cycle through the bottom of the cache).
* Prefix structure: the hashes of one ``touch``/``insert`` call are one
  chain in prefix order; they are filed tail first, so among equals a chain
  loses its tail before its head (a head without its tail still serves a
  shorter prefix; a tail without its head serves nothing).
* Admission: the last block of a store call (a prompt's last block, often
  partial, which a later prompt rarely repeats) is a class of its own. The
  policy learns online, with ghosts and ageing, how often a stored block of
  each class (*tail*, *body*) is reused; while tails are reused less than
  half as often as bodies, a new tail enters at the bottom (``H = L``,
  evicted first) instead of at ``L + 1``. A tail that does get reused
  comes back with its ghost count like any block.

Assumptions, and when it loses:

* one ``insert`` stores the missing part of one prompt, in prefix order (the
  replay and the runtime do). Other call shapes only blur the tail class:
  its learned rate then matches the body's and every block is admitted.
* reuse is skewed (some chains are used much more than others, for longer
  than a cache turnover). A workload where every block is reused about as
  often, at one distance, gets LRU's order (all blocks share ``f``); a
  sudden shift of the hot set costs the old set's surplus ``f`` turnovers.
* a hot chain met once more after a long pause beats fresh blocks for up to
  ``MAX_FREQ`` turnovers; that is the price of keeping it through a scan.

Costs: ``touch`` is one dict lookup and two stores per resident hash
(priorities are updated lazily: a block touched since it was filed is
re-filed when an eviction reaches its old priority, once per touch at most);
``insert`` and ``evict`` move whole chains with C-level dict operations and
are amortised O(1) per block. Pinned or in-flight blocks an eviction passes
are parked until :meth:`released`, so later evictions do not pass them
again. Memory: three dict entries per resident block, plus the ghost list.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import compress, filterfalse, repeat
from operator import itemgetter, not_

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.base import EvictionPolicy, Victim

#: a block's use count saturates here (bounds how long a formerly hot
#: block outlives the cold ones, and the priority range an eviction walks)
MAX_FREQ = 64
#: evicted hashes whose use count is remembered, per block of capacity
GHOST_FACTOR = 4
#: classes of a stored block not used yet
BODY, TAIL = 0, 1
#: prior of each class's reuse rate: (reused, entered)
PRIOR_REUSED, PRIOR_ENTERED = 1.0, 4.0
#: tails are admitted normally while their reuse rate is at least this
#: share of the body's
TAIL_ADMIT_SHARE = 0.5

_HASH = itemgetter(0)
#: runs an iterator to its end at C speed
_drain = deque[object](maxlen=0).extend


class ReusePolicy(EvictionPolicy):
    """Frequency with dynamic ageing over prefix chains, ghost-remembered
    counts and a learned admission of prompt tails (see the module doc)."""

    name = "reuse"
    list_names = ("new", "reused", "parked", "ghost")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        #: every resident block (parked ones too)
        self.blocks: dict[BlockHash, Handle] = {}
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]
        #: use count of resident blocks whose store completed
        self._freq: dict[BlockHash, int] = {}
        #: priority each resident block should be filed at (``age + f`` at
        #: its last use); it differs from its bucket's when touched since
        self._want: dict[BlockHash, int] = {}
        #: priority -> its blocks, least recently filed first
        self._buckets: dict[int, OrderedDict[BlockHash, Handle]] = {}
        #: no bucket below this one holds a block
        self._lo = 0
        #: pinned or in-flight blocks an eviction passed, until released
        self.parked: dict[BlockHash, Handle] = {}
        #: evicted hash -> its use count
        self._ghost: OrderedDict[BlockHash, int] = OrderedDict()
        #: never-used tails, resident or ghost (for learning their rate)
        self._tails: set[BlockHash] = set()
        self._age = 0
        self._used = 0  # resident blocks used at least twice
        self._entered = [0.0, 0.0]
        self._reused = [0.0, 0.0]
        self.ghost_hits = {"ghost": 0}
        self.evictions = {"new": 0, "reused": 0}

    def get(self, block_hash: BlockHash) -> Handle | None:  # replaced per instance
        return self.blocks.get(block_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[Handle | None]:
        return list(map(self.blocks.get, block_hashes))

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        return list(filterfalse(self.blocks.__contains__, block_hashes))

    def __len__(self) -> int:
        return len(self.blocks)

    # -- learning ------------------------------------------------------------

    def reuse_rates(self) -> tuple[float, float]:
        """Learned share of stored (body, tail) blocks used again."""
        e, r = self._entered, self._reused
        return (
            (r[BODY] + PRIOR_REUSED) / (e[BODY] + PRIOR_ENTERED),
            (r[TAIL] + PRIOR_REUSED) / (e[TAIL] + PRIOR_ENTERED),
        )

    def _admits_tails(self) -> bool:
        body, tail = self.reuse_rates()
        return tail >= TAIL_ADMIT_SHARE * body

    def _first_reuse(self, h: BlockHash) -> None:
        tails = self._tails
        if h in tails:
            tails.discard(h)
            self._reused[TAIL] += 1
        else:
            self._reused[BODY] += 1

    # -- filing --------------------------------------------------------------

    def _bucket(self, prio: int) -> OrderedDict[BlockHash, Handle]:
        bucket = self._buckets.get(prio)
        if bucket is None:
            bucket = self._buckets[prio] = OrderedDict()
            if prio < self._lo:
                self._lo = prio
        return bucket

    # -- the seam ------------------------------------------------------------

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        n = len(block_hashes)
        if n != len(blocks):
            raise ValueError("insert needs one block per hash")
        if not n:
            return
        self.blocks.update(zip(block_hashes, blocks, strict=True))
        ghost = self._ghost
        revived = list(filter(ghost.__contains__, block_hashes)) if ghost else []
        age = self._age
        want = self._want
        if not revived:
            # the usual store: one chain of new blocks, tail first
            tail = block_hashes[-1]
            tail_prio = age + 1 if self._admits_tails() else age
            self._bucket(tail_prio)[tail] = blocks[-1]
            want[tail] = tail_prio
            self._tails.add(tail)
            if n > 1:
                body = block_hashes[-2::-1]
                self._bucket(age + 1).update(zip(body, blocks[-2::-1], strict=True))
                want.update(zip(body, repeat(age + 1)))
            self._entered[TAIL] += 1
            self._entered[BODY] += n - 1
        else:
            freq, tails = self._freq, self._tails
            admit_tails = self._admits_tails()
            for i in range(n - 1, -1, -1):
                h = block_hashes[i]
                f = ghost.pop(h, None)
                if f is None:
                    is_tail = i == n - 1
                    self._entered[is_tail] += 1
                    prio = age if is_tail and not admit_tails else age + 1
                    if is_tail:
                        tails.add(h)
                else:
                    freq[h] = f  # a count to start from when released
                    self._used += f > 1
                    prio = age + f
                self._bucket(prio)[h] = blocks[i]
                want[h] = prio
        entered = self._entered
        if entered[BODY] + entered[TAIL] > self.capacity:
            for lst in (entered, self._reused):
                lst[BODY] *= 0.5
                lst[TAIL] *= 0.5

    def remove(self, block_hash: BlockHash) -> Handle | None:
        b = self.blocks.pop(block_hash, None)
        if b is None:
            return None
        prio = self._want.pop(block_hash)
        if self.parked.pop(block_hash, None) is None:
            for p in (prio, *self._buckets):  # filed at its wanted priority, usually
                bucket = self._buckets.get(p)
                if bucket is not None and bucket.pop(block_hash, None) is not None:
                    if not bucket:
                        del self._buckets[p]
                    break
        self._used -= self._freq.pop(block_hash, 1) > 1
        self._tails.discard(block_hash)
        return b

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        freq_get, freq, want = self._freq.get, self._freq, self._want
        ghost = self._ghost
        age = self._age
        for h in reversed(block_hashes):
            f = freq_get(h)
            if f is None:  # not resident, or its store is still in flight
                if ghost:
                    g = ghost.get(h)
                    if g is not None:
                        self.ghost_hits["ghost"] += 1
                        if g == 1:
                            self._first_reuse(h)
                        if g < MAX_FREQ:
                            ghost[h] = g + 1
                continue
            if f < MAX_FREQ:
                if f == 1:
                    self._first_reuse(h)
                    self._used += 1
                f += 1
                freq[h] = f
            want[h] = age + f

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        if n <= 0:
            return []
        if n > len(self.blocks) - len(self.parked):
            return None
        buckets, want, parked, busy = self._buckets, self._want, self.parked, self.busy
        victims: list[Victim] = []
        skipped: list[tuple[int, BlockHash, Handle]] = []  # protected
        taken: list[tuple[int, list[Victim]]] = []  # what may have to go back
        prio = self._lo
        top = max(buckets, default=prio - 1)
        last = self._age
        contains = protected.__contains__
        while (need := n - len(victims)) and prio <= top:
            bucket = buckets.get(prio)
            if bucket is None:
                prio += 1
                continue
            batch = list(map(bucket.popitem, repeat(False, min(need, len(bucket)))))
            wanted = list(map(want.__getitem__, map(_HASH, batch)))
            if wanted.count(prio) != len(batch):
                # touched since filed here: re-filed where they belong now
                stale = list(map(prio.__ne__, wanted))
                for (h, b), w in zip(compress(batch, stale), compress(wanted, stale), strict=True):
                    self._bucket(w)[h] = b
                    if w > top:
                        top = w
                batch = list(compress(batch, map(not_, stale)))
            if busy:
                refs = list(map(busy.get, map(_HASH, batch), repeat(0)))
                if any(refs):  # in use: out of the order until released
                    parked.update(compress(batch, refs))
                    batch = list(compress(batch, map(not_, refs)))
            taken.append((prio, batch))
            named = list(map(contains, map(_HASH, batch)))
            if any(named):
                skipped += ((prio, h, b) for h, b in compress(batch, named))
                batch = list(compress(batch, map(not_, named)))
            if batch:
                victims += batch
                last = prio
            if not bucket:
                del buckets[prio]
                prio += 1
        ok = len(victims) == n
        if not ok:  # put back what was taken, where it was, in order
            for p, batch in reversed(taken):
                for h, b in reversed(batch):
                    self._put_front(p, h, b)
            self._lo = min(buckets, default=prio)
            return None
        for p, h, b in reversed(skipped):
            self._put_front(p, h, b)
        self._lo = min(prio, skipped[0][0]) if skipped else prio
        self._age = last
        hashes = list(map(_HASH, victims))
        _drain(map(self.blocks.__delitem__, hashes))
        _drain(map(want.__delitem__, hashes))
        counts = list(map(self._freq.pop, hashes, repeat(1)))
        ghost = self._ghost
        ghost.update(zip(hashes, counts, strict=True))
        new = counts.count(1)
        self._used -= n - new
        self.evictions["reused"] += n - new
        self.evictions["new"] += new
        extra = len(ghost) - GHOST_FACTOR * self.capacity
        if extra > 0:
            gone = map(_HASH, map(ghost.popitem, repeat(False, extra)))
            self._tails.difference_update(gone)
        return victims

    def _put_front(self, prio: int, h: BlockHash, b: Handle) -> None:
        bucket = self._bucket(prio)
        bucket[h] = b
        bucket.move_to_end(h, last=False)

    def released(self, block_hashes: Sequence[BlockHash]) -> None:
        freq = self._freq
        # stores that completed start counting their uses from one
        freq.update(zip(filterfalse(freq.__contains__, block_hashes), repeat(1)))
        parked = self.parked
        if not parked:
            return
        want, age = self._want, self._age
        for h in filter(parked.__contains__, block_hashes):
            # it was in use until now: filed as used now, at today's age
            w = want[h] = age + freq[h]
            self._bucket(w)[h] = parked.pop(h)

    def ordered_items(self) -> Iterator[tuple[BlockHash, Handle]]:
        want = self._want
        order: list[tuple[int, int, BlockHash, Handle]] = []
        for prio in sorted(self._buckets):
            for h, b in self._buckets[prio].items():
                order.append((want[h], len(order), h, b))
        order.sort(key=itemgetter(0, 1))
        items = [(h, b) for _, _, h, b in order]
        items += self.parked.items()  # in use: the most recent
        return iter(items)

    def seed(self, items: Iterable[tuple[BlockHash, Handle]]) -> None:
        # Another policy's order (first evicted first) becomes recency order
        # among blocks used once; learned rates start from the prior.
        prio = self._age + 1
        bucket = self._bucket(prio)
        for h, b in items:
            self.blocks[h] = b
            bucket[h] = b
            self._want[h] = prio
            if self.busy.get(h, 0) >= 0:  # its store completed
                self._freq[h] = 1

    def list_sizes(self) -> dict[str, int]:
        return {
            "new": len(self.blocks) - self._used,
            "reused": self._used,
            "parked": len(self.parked),
            "ghost": len(self._ghost),
        }

    def params(self) -> dict[str, float]:
        body, tail = self.reuse_rates()
        return {
            "age": float(self._age),
            "reuse_rate_body": body,
            "reuse_rate_tail": tail,
            "tail_admitted": 1.0 if tail >= TAIL_ADMIT_SHARE * body else 0.0,
        }

    def clear_ghosts(self) -> None:
        self._ghost.clear()
        self._tails.intersection_update(self.blocks)
