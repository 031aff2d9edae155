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
generator's workloads is one: ``docs/policies.md`` has every figure). The
ghost lists cost memory: up to ``4 x GHOST_FACTOR x capacity`` hashes
beyond the resident blocks (one block-table entry each, about 50 bytes).

Throughput: 0.88-1.02x LRU's block operations per second
(``bench/managers.py``, two runs on a shared machine; issue 8 asked 0.7x,
and it was 0.69-0.80x before insert and eviction were one table call
each). Touch is the table's, with
rules; insert is one table call (``insert_chain``); eviction is one table
call too (``evict`` with ``target`` and ``trim``: the two-list walk, then a
ghost trim every ``GHOST_FACTOR x capacity`` victims or so), and the table
counts the victims by list.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.arc import B1, B2, T1, T2, TwoListPolicy
from kvoffload.policies.base import Victims
from kvoffload.table import STAY, BlockTable, TouchRules

__all__ = ["GHOST_FACTOR", "KVARCPolicy"]

#: ghosts remembered, in multiples of the capacity
GHOST_FACTOR = 2


class KVARCPolicy(TwoListPolicy):
    """ARC with ghost readmission to T2, long ghost memory, chains filed
    tail first and prompt tails admitted cold (see the module doc)."""

    name = "kvarc"
    initial_target_share = 0.5  # no evidence either way
    # A T1 block used again moves to T2. One whose store is in flight stays
    # where insert filed it: vLLM's scheduler touches a request's blocks
    # right after prepare_store, which is not a second use, and moving them
    # would undo the tail-first filing and the cold tail. Ghosts are counted
    # when stored again, not when touched.
    touch_rules = TouchRules(ready={T1: T2}, in_flight={T1: STAY})

    #: the table's eviction counts each name reports: (tag, held)
    _counted: ClassVar[dict[str, tuple[int, bool]]] = {"t1": (T1, False), "t2": (T2, False)}
    #: evictions may take held blocks once T1 and T2 run out (hkvarc)
    _spill: ClassVar[bool] = False

    def __init__(self, capacity: int, table: BlockTable) -> None:
        super().__init__(capacity, table)
        # Each ghost list keeps at least `bound` hashes; the table trims it
        # back to that once an eviction leaves it with more than twice as many.
        self._bound = GHOST_FACTOR * capacity

    @property
    def evictions(self) -> dict[str, int]:
        """Blocks evicted, by the list they left: the table's counts
        (``evicted``) since this policy was made, so that an eviction counts
        nothing in Python. (The table's, so read them while this is its
        policy: the manager does, and once more as it switches away.)"""
        evicted, since = self.table.evicted, self._evictions_since
        return {name: evicted(*at) - since[name] for name, at in self._counted.items()}

    @evictions.setter
    def evictions(self, counts: dict[str, int]) -> None:
        # the counts are `counts` as of now (the base class starts them at 0)
        evicted = self.table.evicted
        self._evictions_since = {
            name: evicted(*at) - counts.get(name, 0) for name, at in self._counted.items()
        }

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        # head most recent (the chain's tail is evicted first), ghosts to T2,
        # a tail that was no ghost to T1's cold end: one table call
        met = self.table.insert_chain(block_hashes, blocks, T1, T2)
        if met is None:
            return
        # Wanted again after eviction: proven useful, so T2. And ARC's
        # adaptation, once for the batch: a T1 ghost says T1 was too small
        # (its target grows by max(1, |B2|/|B1|) per ghost), a T2 ghost the
        # reverse; the ghost lists as they were before these left them.
        # (Written out without max() and min(), which cost a third of it:
        # the same floating-point operations in the same order.)
        table = self.table
        hit1, hit2 = met.count(B1), met.count(B2)
        b1, b2 = table.size(B1) + hit1, table.size(B2) + hit2
        target, ghost_hits = self.target_t1_size, self.ghost_hits
        if hit1:
            target += (b2 / b1 if b2 > b1 else 1.0) * hit1
            ghost_hits["b1"] += hit1
        if hit2:
            target -= (b1 / b2 if b1 > b2 else 1.0) * hit2
            ghost_hits["b2"] += hit2
        cap = float(self.capacity)
        self.target_t1_size = cap if target >= cap else target if target > 0.0 else 0.0

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        return self._evict_to(self.target_t1_size, n, protected)

    def _evict_to(self, target: float, n: int, protected: Container[BlockHash]) -> Victims | None:
        # T1 down to `target` once the n blocks being stored join it, then
        # T2, then T1 again (with _spill, then the held blocks); the victims
        # become ghosts, and a ghost list past twice its bound is trimmed
        picked = self.table.evict(
            T1,
            n,
            protected,
            b=T2,
            target=target,
            ghost_a=B1,
            ghost_b=B2,
            spill=self._spill,
            trim=self._bound,
        )
        return None if picked is None else picked[:2]
