"""A recency-ordered list of resident blocks that parks pinned blocks.

The building block of the LRU and ARC policies. Blocks are kept in an
``OrderedDict``, least recently used first. An eviction pops entries from
the old end in batches and sorts them with C-level filters (no Python step
per block in the usual case where they are all evictable). A block pinned
by loads that it meets is *parked* in a side table: it is in use, it stays
resident and visible (as the most recent entries), and it comes back to the
recent end when its last load completes (:meth:`RecencyList.release`). A
block whose store is still in flight moves to the recent end (a store
completes soon; its completion need not be watched). Either way no later
eviction passes it again soon: eviction is O(1) amortised per victim
however many blocks are busy (vLLM rescans them every time, defect 10).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Mapping
from itertools import chain, compress, repeat
from operator import itemgetter, not_

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle

#: ``(hash, handle)``, as ``OrderedDict.popitem`` returns it
Entry = tuple[BlockHash, Handle]

_HASH = itemgetter(0)
_POSITIVE = (0).__lt__  # 0 < ref_cnt: pinned by loads
_NEGATIVE = (0).__gt__  # 0 > ref_cnt: store in flight


class Taken:
    """What one eviction has popped from one :class:`RecencyList` so far,
    kept until it commits or rolls back."""

    __slots__ = ("in_flight", "pinned", "seen", "skipped")

    def __init__(self) -> None:
        self.seen: list[Entry] = []  # every entry popped, in order
        self.pinned: list[Entry] = []  # to park
        self.in_flight: list[Entry] = []  # to the recent end
        self.skipped: list[Entry] = []  # protected: back to the old end


class RecencyList(Mapping[BlockHash, Handle]):
    """Resident blocks, least recently used first; parked blocks last.

    A read-only ``Mapping`` (``in``, ``len``, iteration in eviction order,
    ``items()``...); the policy changes it through :attr:`order`,
    :attr:`parked` and the methods below.
    """

    __slots__ = ("order", "parked")

    def __init__(self) -> None:
        #: blocks not known to be busy, least recently used first
        self.order: OrderedDict[BlockHash, Handle] = OrderedDict()
        #: pinned blocks an eviction passed, waiting for :meth:`release`
        self.parked: dict[BlockHash, Handle] = {}

    # -- Mapping ----------------------------------------------------------

    def __getitem__(self, block_hash: BlockHash) -> Handle:
        b = self.order.get(block_hash)
        return b if b is not None else self.parked[block_hash]

    def get(self, block_hash: BlockHash, default: Handle = None) -> Handle:
        b = self.order.get(block_hash)
        if b is None and self.parked:
            b = self.parked.get(block_hash)
        return default if b is None else b

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.order or block_hash in self.parked

    def __len__(self) -> int:
        return len(self.order) + len(self.parked)

    def __iter__(self) -> Iterator[BlockHash]:
        return chain(self.order, self.parked)

    def entries(self) -> list[Entry]:
        """Every entry in eviction order (a copy)."""
        return [*self.order.items(), *self.parked.items()]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"

    # -- changes ------------------------------------------------------------

    def remove(self, block_hash: BlockHash) -> Handle | None:
        b = self.order.pop(block_hash, None)
        if b is None and self.parked:
            b = self.parked.pop(block_hash, None)
        return b

    def release(self, block_hashes: Iterable[BlockHash]) -> None:
        """Parked blocks among ``block_hashes`` go back, most recent."""
        parked = self.parked
        if parked:
            order, pop = self.order, parked.pop
            for h in filter(parked.__contains__, block_hashes):
                order[h] = pop(h)

    def take(
        self,
        n: int,
        protected: Container[BlockHash],
        busy: Mapping[BlockHash, int],
        taken: Taken,
    ) -> list[Entry]:
        """Pop up to ``n`` entries from the old end that are neither busy
        (reference counts by hash, as the manager keeps them) nor in
        ``protected``, and return them; what else was popped is noted in
        ``taken``. Follow with :meth:`commit` or :meth:`rollback`."""
        order = self.order
        pop = order.popitem
        contains = protected.__contains__
        victims: list[Entry] = []
        while (need := n - len(victims)) > 0 and order:
            batch = list(map(pop, repeat(False, min(need, len(order)))))
            taken.seen += batch
            if busy and not busy.keys().isdisjoint(map(_HASH, batch)):
                refs = list(map(busy.get, map(_HASH, batch), repeat(0)))
                taken.pinned += compress(batch, map(_POSITIVE, refs))
                taken.in_flight += compress(batch, map(_NEGATIVE, refs))
                batch = list(compress(batch, map(not_, refs)))
            named = list(map(contains, map(_HASH, batch)))
            if any(named):
                taken.skipped += compress(batch, named)
                batch = list(compress(batch, map(not_, named)))
            victims += batch
        return victims

    def commit(self, taken: Taken) -> None:
        """The victims are gone: park the pinned entries passed, move the
        in-flight ones to the recent end, put the protected ones back at the
        old end."""
        if taken.pinned:
            self.parked.update(taken.pinned)
        if taken.in_flight:
            self.order.update(taken.in_flight)
        if taken.skipped:
            push_front(self.order, taken.skipped)

    def rollback(self, taken: Taken) -> None:
        """Put every popped entry back where it was."""
        if taken.seen:
            push_front(self.order, taken.seen)


def take_from_two(
    first_list: RecencyList,
    second_list: RecencyList,
    first: int,
    n: int,
    protected: Container[BlockHash],
    busy: Mapping[BlockHash, int],
) -> tuple[list[Entry], list[Entry]] | None:
    """Evict ``n`` entries from two lists, all or nothing: up to ``first``
    from ``first_list``, the rest from ``second_list``, then from
    ``first_list`` again if the second ran short (ARC's T1/T2 order). Each
    run resumes where its list's previous one stopped. Returns the victims
    of each list, or ``None`` with both lists unchanged."""
    a, b = first_list, second_list
    if n > len(a.order) + len(b.order):  # parked blocks are all busy
        return None
    if len(busy) == len(a.parked) + len(b.parked):
        busy = {}  # the busy blocks are all parked: the scans need not look
    taken_a, taken_b = Taken(), Taken()
    va = a.take(first, protected, busy, taken_a)
    vb = b.take(n - len(va), protected, busy, taken_b) if len(va) < n else []
    if len(va) + len(vb) < n:
        va += a.take(n - len(va) - len(vb), protected, busy, taken_a)
        if len(va) + len(vb) < n:
            a.rollback(taken_a)
            b.rollback(taken_b)
            return None
    a.commit(taken_a)
    b.commit(taken_b)
    return va, vb


def push_front(od: OrderedDict[BlockHash, Handle], entries: list[Entry]) -> None:
    """Put ``entries`` (oldest first) back at the oldest end of ``od``."""
    to_front = od.move_to_end
    for h, b in reversed(entries):
        od[h] = b
        to_front(h, last=False)


__all__ = ["Entry", "RecencyList", "Taken", "push_front", "take_from_two"]
