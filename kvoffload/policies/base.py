"""The eviction-policy seam.

A policy orders the resident blocks of a manager's
:class:`~kvoffload.table.BlockTable` and picks victims: it names the table
lists it keeps blocks in, chooses the list a stored block enters, what a
touch does (:class:`~kvoffload.table.TouchRules`) and which lists an
eviction takes from. Everything else (reference counts, protection of the
hashes a call names, atomicity, events, counters, the live switch) belongs
to :class:`~kvoffload.manager.PolicyOffloadingManager`, the table and this
base class, and is written once. ``docs/writing-a-policy.md`` walks through
a policy; ``docs/block-table.md`` says what the table does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Container, Sequence
from enum import IntEnum
from typing import Any, ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.errors import PolicyError
from kvoffload.table import RESIDENT_TAGS, TAGS, BlockTable, TouchRules

__all__ = ["EvictionPolicy", "Victims"]

#: what an eviction returns: the victims' hashes and their handles, in order
Victims = tuple[list[BlockHash], list[Handle]]


class EvictionPolicy(ABC):
    """Orders the resident blocks of ``table`` and chooses which to evict.

    A subclass declares :attr:`name` and :attr:`lists`, may declare
    :attr:`touch_rules`, and implements :meth:`insert` and :meth:`evict`
    (usually one table call each). The base class seeds the lists, applies
    the touch rules, counts evictions by list (:meth:`evict_from`) and
    reports list sizes.

    Contract every policy keeps (checked by ``tests/core/test_contract.py``
    and the state machine in ``tests/core/test_state_machine.py``):

    * :meth:`seed` is called once, before anything else, with the blocks
      already resident (another policy's :meth:`ordered_items`, or none);
    * :meth:`insert` adds newly allocated blocks (their stores in flight);
    * ``evict(n, protected)`` is all-or-nothing: it returns exactly ``n``
      victims, none pinned, in flight or in ``protected``, taken out of the
      table; or ``None``, changing nothing. The table's ``evict`` gives
      this, O(log n) per victim however many blocks are busy;
    * :meth:`ordered_items` yields every resident block, least valuable
      first.
    """

    #: the name users select the policy by (``"lru"``, ``"arc"``...)
    name: ClassVar[str]
    #: the table lists the policy keeps, by name: an ``IntEnum`` whose values
    #: are table tags, 0..3 for lists of resident blocks (the first is where
    #: :meth:`seed` puts the blocks it takes over; :meth:`ordered_items`
    #: reads them in this order) and 4..7 for ghost lists. Stats and
    #: metrics report each list under its name in lower case.
    lists: ClassVar[type[IntEnum]]
    #: what a touch does to the blocks of each list (default: LRU in each)
    touch_rules: ClassVar[TouchRules] = TouchRules()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        lists = cls.__dict__.get("lists")
        if lists is None:
            return
        tags = [int(tag) for tag in lists]
        if not tags or not 0 <= tags[0] < RESIDENT_TAGS or not all(0 <= t < TAGS for t in tags):
            raise PolicyError(
                f"{cls.__name__}.lists must be an IntEnum of table tags, the first a resident "
                f"list (0..3), ghost lists 4..7; got {[(m.name, int(m)) for m in lists]}"
            )

    def __init__(self, capacity: int, table: BlockTable) -> None:
        if not hasattr(self, "lists"):
            raise PolicyError(
                f"{type(self).__name__} declares no `lists`: an IntEnum naming the block-table "
                "lists it keeps (see docs/writing-a-policy.md)"
            )
        self.capacity = capacity
        self.table = table
        self._names = {int(tag): tag.name.lower() for tag in self.lists}
        self._resident = [tag for tag in self.lists if tag < RESIDENT_TAGS]
        self._ghost_lists = [tag for tag in self.lists if tag >= RESIDENT_TAGS]
        #: blocks evicted, by the list they were evicted from
        self.evictions: dict[str, int] = {self._names[t]: 0 for t in self._resident}
        #: hits on a ghost list, by its name (counted by the policy)
        self.ghost_hits: dict[str, int] = {self._names[t]: 0 for t in self._ghost_lists}
        if type(self).touch is EvictionPolicy.touch:
            self.touch = table.touch  # type: ignore[method-assign,assignment]  # no Python frame

    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        """Take over the resident blocks ``items`` (first to be evicted
        first): they go to the first of :attr:`lists`, and the table's touch
        rules become :attr:`touch_rules`."""
        self.table.set_touch_rules(self.touch_rules)
        self.table.relist([h for h, _ in items], self._resident[0])

    @abstractmethod
    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        """File newly allocated blocks (not yet in the table)."""

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Record a use of the blocks; the first hash ends most recent. The
        default is the table's touch with :attr:`touch_rules`."""
        self.table.touch(block_hashes)

    @abstractmethod
    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        """Remove and return ``n`` evictable blocks, or ``None`` (no change)."""

    def admit(
        self, block_hashes: Sequence[BlockHash], n_evict: int, protected: Collection[BlockHash]
    ) -> int:
        """How many of ``block_hashes`` (the absent hashes of a
        ``prepare_store`` call, in order) to store, the rest declined.

        Asked when storing all of them would evict ``n_evict >= 1`` blocks
        and the victims may have to include hinted ones: whenever fewer
        than ``n_evict`` ready blocks (not pinned, not in flight) are
        neither used by a request in the hint window nor named in the call
        (``protected``: every hash the call names), and never when no
        block is hinted or ``n_evict`` is at most the ready blocks less
        the hinted and the named ones. In between (a hinted or named block
        busy) it may be asked when the others would do: a policy that
        declines counts for itself (``hkvarc`` does, with the table's
        ``held_ready`` and ``farthest``). Storing a prefix keeps a chain a
        chain. Changes nothing but the policy's own counters.

        The default stores everything, and the manager does not ask a
        policy that keeps it. A policy that declines makes ``prepare_store``
        return the prefix it keeps as ``block_hashes_to_store`` (callers
        complete those only, as vLLM's do).
        """
        return len(block_hashes)

    def evict_from(
        self,
        a: int,
        n: int,
        protected: Container[BlockHash],
        *,
        b: int | None = None,
        first: int | None = None,
        ghost_a: int | None = None,
        ghost_b: int | None = None,
    ) -> Victims | None:
        """The table's ``evict`` (up to ``first`` victims from list ``a``,
        then from ``b``, then from ``a`` again; victims of ``a`` become ghosts
        in ``ghost_a``, of ``b`` in ``ghost_b``), counting the victims by
        the list they left."""
        picked = self.table.evict(
            a, n, protected, b=b, first=first, ghost_a=ghost_a, ghost_b=ghost_b
        )
        if picked is None:
            return None
        hashes, handles, n_a = picked
        self.evictions[self._names[a]] += n_a
        if n_a < n:
            assert b is not None
            self.evictions[self._names[b]] += n - n_a
        return hashes, handles

    def ordered_items(self) -> list[tuple[BlockHash, Handle]]:
        """Every resident block, first to be evicted first."""
        table = self.table
        return [item for tag in self._resident for item in table.items(tag)]

    @property
    def ghost_list_names(self) -> frozenset[str]:
        """The names of the ghost lists among :attr:`lists`."""
        return frozenset(self._names[t] for t in self._ghost_lists)

    def list_sizes(self) -> dict[str, int]:
        """The size of each of :attr:`lists`, by name."""
        size = self.table.size
        return {name: size(tag) for tag, name in self._names.items()}

    def params(self) -> dict[str, float]:
        """The policy's adaptive parameters (for stats and metrics)."""
        return {}

    def counters(self) -> dict[str, int]:
        """The policy's own monotonic counters since it was made, by name
        (for stats and metrics; e.g. how often it used a hint). None by
        default."""
        return {}

    def clear_ghosts(self) -> None:
        """Forget history kept for blocks that are no longer resident."""
        for tag in self._ghost_lists:
            self.table.trim(tag, 0)
