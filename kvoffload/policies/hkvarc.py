"""kvarc with hints ("hkvarc"): nearest next use within what the waiting
queue shows, kvarc's order beyond it.

A manager's hint window (``docs/writing-a-policy.md``, "Hints") says which
blocks the requests waiting to be served will use, and in what order. hkvarc
uses it, and without hints it is kvarc exactly (same lists, orders, victims
and answers: ``tests/policies/test_hkvarc.py`` checks it under Hypothesis,
and the replays of both shared traces give the same hits):

* **kvarc on the blocks no waiting request uses**: T1/T2, the ghost lists
  B1/B2, its adaptive target, chains filed tail first, the prompt tail
  admitted cold. The target is a share of the blocks kvarc orders: with H
  blocks held, T1 in line is evicted down to ``target * (capacity - H) /
  capacity`` (a held block is not kvarc's to place; counting the held H1
  blocks as T1 against the whole target, as the first version did, let the
  share of held blocks that happened to come from T1 set the balance).
* **Hinted blocks are held.** A resident block that a request in the window
  will use leaves kvarc's order (the table's hint order holds it) and
  remembers its class: H1 if it is in T1, H2 if in T2. When its last
  hinted use comes (``unhint``, right before the request is served) it
  rejoins its list at the most recent end, and the request's touch then
  files it as kvarc would (T2).
* **Evictions take T1/T2 first**, in kvarc's order, and only then held
  blocks, farthest next use first (on a tie, the later position in the
  request: a chain's tail before its head). Every unhinted block is next
  used after every hinted one, as far as anyone can know, so this is
  Belady's choice within the window; and a block's next use is never
  before its parent's, so a hinted chain loses its tail first. A held
  victim becomes a B1 or B2 ghost by its class.
* **Declined stores.** When a store would reach held blocks (the ready
  blocks of T1 and T2 in line that the call does not name cannot give all
  the room), the first absent blocks take the room those give and each
  one after them would evict a held block, farthest next use first. It
  keeps the absent blocks in chain order while each is hinted nearer than
  the held block it would evict, and declines the rest of the chain
  (``prepare_store`` returns the prefix kept as ``block_hashes_to_store``);
  one that would need more held blocks than there are is refused whole.
  Never with an empty window.

Exported as the ARC family's are: lists ``t1``, ``t2`` (in kvarc's order,
not held), ``h1``, ``h2`` (held, by class), ghosts ``b1``, ``b2``; resident
lists sum to the used blocks. Counters (:meth:`HKVARCPolicy.counters`):
``deferred`` (blocks held out of kvarc's order because a waiting request
uses them), ``redirected`` (victims taken from held blocks), ``declined_blocks``
and ``hinted_hits`` (blocks hinted requests found resident when they left
the window). ``docs/policies.md`` has the design, every figure, and where
it loses.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.policies.arc import B1, B2, T1, T2
from kvoffload.policies.base import Victims
from kvoffload.policies.kvarc import KVARCPolicy
from kvoffload.table import BlockTable

__all__ = ["HKVARCPolicy"]


class HKVARCPolicy(KVARCPolicy):
    """kvarc that holds blocks the hint window says are coming, evicts them
    last (farthest next use first) and declines stores that would evict
    nearer ones (see the module doc)."""

    name = "hkvarc"
    # kvarc's eviction (T1 down to its target, then T2, then T1), then the
    # held blocks, farthest next use first: a held victim is counted by its
    # class (h1, h2), as the table counts it
    _counted: ClassVar[dict[str, tuple[int, bool]]] = {
        **KVARCPolicy._counted,
        "h1": (T1, True),
        "h2": (T2, True),
    }
    _spill = True

    def __init__(self, capacity: int, table: BlockTable) -> None:
        super().__init__(capacity, table)
        # the table's statistics as this policy started
        self._holds_before = self._found_before = 0
        self._declined = 0

    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        super().seed(items)
        table = self.table
        # holding the blocks the window already names counts as deferring them
        self._holds_before, self._found_before = table.holds, table.window_found
        table.set_hint_order(True)

    def _t1_in_line(self) -> tuple[float, int]:
        # kvarc's T1 target is a share of the cache kvarc orders, and held
        # blocks have left its order: with H held, T1 in line is held to
        # target * (capacity - H) / capacity (nothing held: kvarc's target,
        # exactly). Returned with H1, the held blocks of T1.
        table, target = self.table, self.target_t1_size
        h1 = table.held(T1)
        held = h1 + table.held(T2)
        if held:
            target = target * (self.capacity - held) / self.capacity
        return target, h1

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        # the table compares the target with all of T1, held H1 included
        in_line, h1 = self._t1_in_line()
        return self._evict_to(in_line + h1, n, protected)

    def params(self) -> dict[str, float]:
        # what to read t1 (in line) against
        return {**super().params(), "target_t1_in_line": self._t1_in_line()[0]}

    def admit(
        self, block_hashes: Sequence[BlockHash], n_evict: int, protected: Collection[BlockHash]
    ) -> int:
        # Asked when the victims may have to include held blocks. Counted
        # exactly: the ready blocks in line (not held) that the call does not
        # name give the first victims; the rest are held ones, farthest next
        # use first. The absent blocks are kept in chain order while each is
        # hinted nearer than the held block its store would evict.
        table = self.table
        stored = len(block_hashes)
        if not table.window_requests:
            return stored  # never with no hints: kvarc's answer stands
        held = table.held_ready
        in_line = len(table) - table.pinned - table.in_flight - held
        ref = table.ref
        for h, key in zip(protected, table.next_uses(protected), strict=True):
            if ref(h) == 0:  # resident and ready: not a victim
                if key >= 0:
                    held -= 1
                else:
                    in_line -= 1
        from_held = n_evict - in_line  # the last victims of the whole store
        if from_held <= 0:
            return stored
        # the first blocks are stored in room that does not cost a held one
        keep = stored - from_held
        displaced = table.farthest(protected, from_held)
        for i, key in enumerate(table.next_uses(block_hashes[keep:])):
            if i == len(displaced):
                # no held block left for it either: the store is refused as
                # a whole (rejected, not declined)
                return stored
            if key < 0 or key >= displaced[i]:
                break  # no hinted use, or one after the block it would evict
            keep += 1
        self._declined += stored - keep
        return keep

    def ordered_items(self) -> list[tuple[BlockHash, Handle]]:
        """T1 then T2 in kvarc's order, then the held blocks, farthest next
        use first (the nearest are the most valuable: last to go)."""
        table = self.table
        in_line: list[tuple[BlockHash, Handle]] = []
        held: list[tuple[BlockHash, Handle]] = []
        for tag in (T1, T2):
            items = table.items(tag)
            cut = len(items) - table.held(tag)
            in_line += items[:cut]
            held += items[cut:]
        uses = table.next_uses([h for h, _ in held])
        order = sorted(range(len(held)), key=uses.__getitem__, reverse=True)
        return in_line + [held[i] for i in order]

    def list_sizes(self) -> dict[str, int]:
        table = self.table
        h1, h2 = table.held(T1), table.held(T2)
        return {
            "t1": table.size(T1) - h1,
            "t2": table.size(T2) - h2,
            "h1": h1,
            "h2": h2,
            "b1": table.size(B1),
            "b2": table.size(B2),
        }

    def counters(self) -> dict[str, int]:
        ev = self.evictions
        return {
            "deferred": self.table.holds - self._holds_before,
            "redirected": ev["h1"] + ev["h2"],
            "declined_blocks": self._declined,
            "hinted_hits": self.table.window_found - self._found_before,
        }
