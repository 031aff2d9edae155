"""Reuse-aware eviction for chained KV blocks ("reuse").

Each resident block sits in one of a few *classes*, each an LRU list:

* ``dead``: its parent block was evicted, so a prefix lookup cannot reach it
  until the parent comes back; evicted first.
* ``new<d><h>``: stored and not reused yet, by where it sat in its store call
  (``d`` = blocks after it in the call, 0, 1, 2 or 3+; ``h`` = 1 if the
  call's first block continued a resident prefix). The last block of a prompt
  (``d`` = 0) is usually partial and is almost never a prefix of a later one.
* ``hot1``, ``hot2``, ``hot3``: reused once, twice, three times or more.

The policy *learns* online, per class, the probability ``p`` that a block
entering the class is reused before it leaves it (evicted blocks are followed
in a ghost list of ``capacity`` hashes, so evictions do not bias ``p`` down);
counts are halved every ``capacity`` stores (ageing), so ``p`` follows a
changing workload. A victim is the class head (its least recently used
block) with the smallest ``p / age``, age counted in block accesses since its
last use: an unpromising class is evicted much earlier, a promising one
later, and within a class the order is LRU. Recency ages frequency too: a
``hot3`` block that nobody touches loses to younger blocks.

Prefix structure: hashes named in one ``touch``/``prepare_store`` call are in
prefix order, so consecutive hashes give parent -> child links; a touch
walks the chain in reverse (the head ends most recent, the tail goes first)
and a store inserts the chain the same way. When a block is evicted, its
resident children move to ``dead``. Admission is soft: a block of a class
with a low ``p`` is stored but is among the first to go, so it costs a slot
only until the next eviction, and a ghost hit on it promotes it to ``hot1``
when it is stored again.

Assumptions, and when it loses:

* one ``prepare_store`` call stores the missing tail of one prompt (the
  replay and the runtime do). If an engine stores in chunks, ``d`` no longer
  means "distance to the prompt's end"; ``p`` per class then flattens and the
  policy degrades towards LRU with frequency classes, it does not break.
* reuse probability is stationary over about ``capacity`` stores. A sudden
  shift (a class that was useless becomes hot) costs hits until the ghost
  hits raise its ``p``.
* ``p / age`` is a heuristic hazard. A workload whose reuses come at one
  fixed long distance (a loop over a working set slightly above the
  capacity) gets LRU's behaviour, not better.
* per block it does a few more dict operations than LRU (about 0.7x-0.8x
  its throughput in the replay), and keeps parent links and a ghost list
  (about three small dict entries per resident block plus ``capacity``
  ghost hashes).

Eviction is amortised O(log classes) per victim: one lazily advanced
iterator per class and a heap of class heads; pinned blocks passed move to
the most recent end of their class (they are in use), as the seam requires.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence

from kvoffload.abstract import BlockHash
from kvoffload.backend import BlockStatus
from kvoffload.policies.base import EvictionPolicy, Victim

DEAD = 0
#: first ``new`` class; new<d><h> = NEW + 2 * d + h
NEW = 1
HOT1, HOT2, HOT3 = 9, 10, 11
NUM_CLASSES = 12
CLASS_NAMES = (
    "dead",
    *(f"new{d}{h}" for d in range(4) for h in range(2)),
    "hot1",
    "hot2",
    "hot3",
)
#: class a reused block moves to
PROMOTE = (HOT1, *([HOT1] * 8), HOT2, HOT3, HOT3)
#: prior of each class's p: (reused, entered)
PRIOR_REUSED = 1.0
PRIOR_ENTERED = 4.0
#: the dead class's p: they are worth something only if the parent returns
DEAD_P = 1e-4


def _group(c: int) -> str:
    if c == DEAD:
        return "dead"
    if c < HOT1:
        return "new"
    return "hot"


class ReusePolicy(EvictionPolicy):
    """Classes by insertion position and reuse count, learned reuse
    probabilities with ageing, dead-chain eviction (see the module doc)."""

    name = "reuse"
    list_names = ("dead", "new", "hot", "ghost")

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.blocks: dict[BlockHash, BlockStatus] = {}
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]
        self._queues: list[OrderedDict[BlockHash, BlockStatus]] = [
            OrderedDict() for _ in range(NUM_CLASSES)
        ]
        #: hash -> [class, last use stamp]
        self._meta: dict[BlockHash, list[int]] = {}
        #: resident parent -> children seen stored after it
        self._kids: dict[BlockHash, list[BlockHash]] = {}
        #: first non-resident hash of a touched chain -> its resident parent
        self._pending_parent: dict[BlockHash, BlockHash] = {}
        #: evicted hash -> class it was evicted from
        self._ghost: OrderedDict[BlockHash, int] = OrderedDict()
        #: hashes whose ghost was hit, -> class to store them in
        self._revived: dict[BlockHash, int] = {}
        self._entered = [0.0] * NUM_CLASSES
        self._reused = [0.0] * NUM_CLASSES
        self._stores_since_decay = 0
        self._now = 0
        self.ghost_hits = {"ghost": 0}

    def get(self, block_hash: BlockHash) -> BlockStatus | None:  # replaced per instance
        return self.blocks.get(block_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    # -- learning ----------------------------------------------------------

    def reuse_probabilities(self) -> list[float]:
        """Current estimate of ``p`` per class (index = class)."""
        e, r = self._entered, self._reused
        p = [(r[c] + PRIOR_REUSED) / (e[c] + PRIOR_ENTERED) for c in range(NUM_CLASSES)]
        p[DEAD] = DEAD_P
        return p

    def _decay(self) -> None:
        self._entered = [x * 0.5 for x in self._entered]
        self._reused = [x * 0.5 for x in self._reused]
        self._stores_since_decay = 0

    # -- the seam ----------------------------------------------------------

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[BlockStatus]) -> None:
        n = len(block_hashes)
        if n != len(blocks):
            raise ValueError("insert needs one block per hash")
        if n == 0:
            return
        meta, queues, kids, entered = self._meta, self._queues, self._kids, self._entered
        ghost_pop, revived = self._ghost.pop, self._revived
        parent = self._pending_parent.pop(block_hashes[0], None)
        cont = 1 if parent is not None and parent in meta else 0
        if cont:
            kids.setdefault(parent, []).append(block_hashes[0])  # type: ignore[arg-type]
        self.blocks.update(zip(block_hashes, blocks, strict=True))
        now = self._now + n
        self._now = now
        # tail first, so the chain's head ends most recent
        for i in range(n - 1, -1, -1):
            h = block_hashes[i]
            d = n - 1 - i
            c = revived.pop(h, -1) if revived else -1
            if c < 0:
                c = NEW + 2 * (d if d < 3 else 3) + cont
            ghost_pop(h, None)
            entered[c] += 1
            queues[c][h] = blocks[i]
            meta[h] = [c, now - i]
            if i:
                p = block_hashes[i - 1]
                k = kids.get(p)
                if k is None:
                    kids[p] = [h]
                else:
                    k.append(h)
        self._stores_since_decay += n
        if self._stores_since_decay >= self.capacity:
            self._decay()

    def remove(self, block_hash: BlockHash) -> BlockStatus | None:
        b = self.blocks.pop(block_hash, None)
        if b is None:
            return None
        m = self._meta.pop(block_hash)
        del self._queues[m[0]][block_hash]
        self._kids.pop(block_hash, None)
        return b

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        meta, queues, ghost = self._meta, self._queues, self._ghost
        entered, reused = self._entered, self._reused
        now = self._now + len(block_hashes)
        self._now = now
        stamp = now
        nxt: BlockHash | None = None
        nxt_resident = True
        for h in reversed(block_hashes):
            m = meta.get(h)
            if m is not None:
                if not nxt_resident:
                    self._pending_parent[nxt] = h  # type: ignore[index]
                nxt_resident = True
                c = m[0]
                q = queues[c]
                b = q[h]
                if b.ref_cnt < 0:
                    # store in flight: the engine touches right after
                    # prepare_store, which is not a reuse
                    q.move_to_end(h)
                else:
                    if c != DEAD:
                        reused[c] += 1
                    c2 = PROMOTE[c]
                    entered[c2] += 1
                    del q[h]
                    queues[c2][h] = b
                    m[0] = c2
                m[1] = stamp
            else:
                nxt_resident = False
                g = ghost.pop(h, None)
                if g is not None:
                    reused[g] += 1
                    self._revived[h] = PROMOTE[g]
                    self.ghost_hits["ghost"] += 1
            nxt = h
            stamp -= 1
        if len(self._pending_parent) > self.capacity:
            self._pending_parent.clear()
        if len(self._revived) > self.capacity:
            self._revived.clear()

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        if n <= 0:
            return []
        p = self.reuse_probabilities()
        now = self._now + 1
        meta = self._meta
        queues = self._queues
        iters: list[Iterator[tuple[BlockHash, BlockStatus]] | None] = [None] * NUM_CLASSES
        passed: list[BlockHash] = []
        heap: list[tuple[float, int, BlockHash, BlockStatus]] = []

        def head(c: int) -> None:
            it = iters[c]
            assert it is not None
            for h, b in it:
                if b.ref_cnt == 0:
                    if h in protected:
                        continue
                    heapq.heappush(heap, (p[c] / (now - meta[h][1]), c, h, b))
                    return
                passed.append(h)

        for c in range(NUM_CLASSES):
            if queues[c]:
                iters[c] = iter(queues[c].items())
                head(c)
        victims: list[Victim] = []
        while len(victims) < n:
            if not heap:
                return None
            _, c, h, b = heapq.heappop(heap)
            victims.append((h, b, _group(c)))
            head(c)
        # mutation, after the selection succeeded
        blocks, ghost, kids = self.blocks, self._ghost, self._kids
        dead = queues[DEAD]
        for h, _, _ in victims:
            m = meta.pop(h)
            c = m[0]
            b = queues[c].pop(h)
            del blocks[h]
            ghost[h] = c
            for k in kids.pop(h, ()):
                mk = meta.get(k)
                if mk is not None and mk[0] != DEAD:
                    bk = queues[mk[0]].pop(k)
                    dead[k] = bk
                    mk[0] = DEAD
        for h in passed:
            entry = meta.get(h)
            if entry is not None:
                queues[entry[0]].move_to_end(h)
                m[1] = now
        self._now = now
        for _ in range(len(ghost) - self.capacity):
            ghost.popitem(last=False)
        return victims

    def ordered_items(self) -> Iterator[tuple[BlockHash, BlockStatus]]:
        p = self.reuse_probabilities()
        now = self._now + 1
        meta = self._meta
        order = sorted(
            self.blocks.items(),
            key=lambda hb: p[meta[hb[0]][0]] / (now - meta[hb[0]][1]),
        )
        return iter(order)

    def seed(self, items: Iterable[tuple[BlockHash, BlockStatus]]) -> None:
        # Another policy's order (first evicted first) becomes recency order
        # in one neutral class; reuse statistics start from the prior.
        q = self._queues[NEW + 2 * 3 + 1]
        meta = self._meta
        for h, b in items:
            self._now += 1
            self.blocks[h] = b
            q[h] = b
            meta[h] = [NEW + 2 * 3 + 1, self._now]

    def list_sizes(self) -> dict[str, int]:
        q = self._queues
        return {
            "dead": len(q[DEAD]),
            "new": sum(len(q[c]) for c in range(NEW, HOT1)),
            "hot": sum(len(q[c]) for c in range(HOT1, NUM_CLASSES)),
            "ghost": len(self._ghost),
        }

    def params(self) -> dict[str, float]:
        p = self.reuse_probabilities()
        return {f"p_{CLASS_NAMES[c]}": p[c] for c in range(1, NUM_CLASSES)}

    def clear_ghosts(self) -> None:
        self._ghost.clear()
        self._revived.clear()
