"""ARC adapted to KV prefix chains ("kvarc").

ARC's two lists and adaptive split, changed where KV workloads differ from
the page caches ARC was designed for:

* **Ghosts readmit to T2.** A block stored again while its hash is still
  remembered (it was evicted, then asked for) goes to T2, the list of
  blocks proven useful, and moves the T1 target as ARC's ghost hits do
  (a B1 ghost grows T1's share by ``max(1, |B2|/|B1|)``, a B2 ghost shrinks
  it). vLLM's ARC puts every stored block in T1, so a chain that comes back
  after eviction is treated as new again.
* **Long memory.** Each ghost list remembers at least ``GHOST_FACTOR`` (2)
  times the capacity (at most twice that: it is trimmed in batches), oldest
  forgotten first: KV prefixes come back at distances of several cache
  sizes (a document asked about again, a conversation resumed), beyond
  ARC's usual one capacity.
* **Chains filed tail first.** A stored chain enters T1 with its head most
  recent, so its tail goes first: a block whose parent is evicted cannot be
  part of a prefix hit, while a head without its tail still can.
* **The tail of a prompt is admitted cold.** The last block of a store call
  is usually partial; the next prompt extends it into a different block, so
  it is almost never read again. It enters at T1's cold end.
* The T1 target starts at half the capacity (no evidence either way), and
  ghost hits are counted when a block is stored again, not when touched,
  once per store call: cheaper, and the same signal in an engine that
  stores what it misses. The hit says the workload came back for the
  block, so it stands even if that store then fails.

How it covers what KV workloads have and generic caches ignore:

* *prefix structure*: chains are filed tail first, so a head outlives its
  tail (a block whose parent is gone cannot be part of a prefix hit);
* *reuse frequency with ageing*: T2 holds blocks with a proven second use
  (touched again, or stored again as a ghost); within each list standing
  ages by recency, and the adaptive target moves room between once-used
  and reused blocks as the ghost hits say which list was too small;
* *admission*: a block seen once enters T1, whose share is bounded by the
  target, so a flood of one-off prompts cannot push out T2; a prompt's
  tail, the block least likely to be read again, enters at T1's cold end.

What it assumes, and when it loses: one ``prepare_store`` call stores the
missing tail of one prompt (the replay and the runtime do); if an engine
stores in other chunks, "the tail" is just the last block of a chunk and
admitting it cold costs a little. A workload whose blocks are each used
once gains nothing (T2 stays empty, it behaves like LRU with a cold tail).
Blocks that come back exactly once, after more than a capacity of other
blocks (a long scan repeated once), are readmitted to T2 as if proven
useful and crowd out real reuse until recency ages them out; a workload
made of such repeats can trail LRU (none of the shared traces or the
generator's workloads is one: ``docs/policies.md`` has every figure). The ghost lists cost memory:
up to ``4 x GHOST_FACTOR x capacity`` hashes beyond the resident blocks (a
plain dict entry each, about 50 bytes).

Throughput: about half to 0.6x LRU's block operations per second, like
ARC (issue 8 asked 0.7x): every stored block is looked up in both ghost
tables and every victim is added to one, and those tables are several
times the capacity, so most of these are cache misses. Touch, absent,
insert and eviction otherwise run on C-level filters and batched dict
operations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Sequence
from itertools import compress, islice
from operator import itemgetter, not_

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.arc import TwoListPolicy
from kvoffload.policies.base import Victim
from kvoffload.policies.recency import take_from_two

#: ghosts remembered, in multiples of the capacity
GHOST_FACTOR = 2

_HASH = itemgetter(0)


def _remember(
    ghosts: dict[BlockHash, None], victims: list[Victim], bound: int
) -> dict[BlockHash, None]:
    """``ghosts`` with the victims' hashes added, newest last. A plain dict
    keeps insertion order; once it holds twice ``bound`` it is rebuilt from
    its newest ``bound`` entries (C-level, amortised O(1) per ghost, and
    cheaper than an ``OrderedDict``'s per-entry links)."""
    ghosts.update(dict.fromkeys(map(_HASH, victims)))
    if len(ghosts) > 2 * bound:
        ghosts = dict.fromkeys(islice(ghosts, len(ghosts) - bound, None))
    return ghosts


class KVARCPolicy(TwoListPolicy):
    """ARC with ghost readmission to T2, long ghost memory, chains filed
    tail first and prompt tails admitted cold (see the module doc)."""

    name = "kvarc"
    initial_target_share = 0.5  # no evidence either way
    b1: dict[BlockHash, None]
    b2: dict[BlockHash, None]

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.b1 = {}
        self.b2 = {}

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        if not block_hashes:
            return
        t1 = self.t1.order
        b1, b2 = self.b1, self.b2
        # head most recent: the chain's tail is evicted first
        chain = list(zip(reversed(block_hashes), reversed(blocks), strict=True))
        hit1 = list(filter(b1.__contains__, block_hashes)) if b1 else []
        hit2 = list(filter(b2.__contains__, block_hashes)) if b2 else []
        if hit1 or hit2:
            # Wanted again after eviction: proven useful, so T2. And ARC's
            # adaptation, once for the batch: a T1 ghost says T1 was too
            # small (its target grows by max(1, |B2|/|B1|) per ghost), a T2
            # ghost the reverse.
            step1 = max(1.0, len(b2) / len(b1)) * len(hit1) if hit1 else 0.0
            step2 = max(1.0, len(b1) / len(b2)) * len(hit2) if hit2 else 0.0
            target = self.target_t1_size + step1 - step2
            self.target_t1_size = min(float(self.capacity), max(0.0, target))
            self.ghost_hits["b1"] += len(hit1)
            self.ghost_hits["b2"] += len(hit2)
            deque(map(b1.__delitem__, hit1), 0)
            deque(map(b2.__delitem__, hit2), 0)
            revived = list(map(set(hit1 + hit2).__contains__, map(_HASH, chain)))
            self.t2.order.update(compress(chain, revived))
            t1.update(compress(chain, map(not_, revived)))
        else:
            t1.update(chain)
        tail = block_hashes[-1]
        if tail in t1:
            t1.move_to_end(tail, last=False)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        rev = block_hashes[::-1]
        t1, t2 = self.t1, self.t2
        o1, o2 = t1.order, t2.order
        busy = self.busy
        # A T1 block used again moves to T2. One whose store is in flight
        # stays where insert filed it: vLLM's scheduler touches a request's
        # blocks right after prepare_store, which is not a second use, and
        # moving them would undo the tail-first filing and the cold tail.
        for h in filter(o1.__contains__, rev):
            if busy.get(h, 0) >= 0:
                o2[h] = o1.pop(h)
        p1 = t1.parked
        if p1:  # pinned by a load and used again: T2's when released
            for h in filter(p1.__contains__, rev):
                t2.parked[h] = p1.pop(h)
        # one C-level pass puts T2's hits in the request's order, head last
        deque(map(o2.move_to_end, filter(o2.__contains__, rev)), 0)

    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        # T1 down to its target once the n blocks being stored join it,
        # then T2, then T1 again
        first = min(n, max(0, int(len(self.t1) + n - self.target_t1_size)))
        picked = take_from_two(self.t1, self.t2, first, n, protected, self.busy)
        if picked is None:
            return None
        v1, v2 = picked
        bound = GHOST_FACTOR * self.capacity
        if v1:
            self.b1 = _remember(self.b1, v1, bound)
        if v2:
            self.b2 = _remember(self.b2, v2, bound)
        self.evictions["t1"] += len(v1)
        self.evictions["t2"] += len(v2)
        return v1 + v2 if v2 else v1
