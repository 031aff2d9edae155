"""The eviction-policy seam.

A policy orders the resident blocks of a manager's
:class:`~kvoffload.table.BlockTable` and picks victims: it chooses the list
(the table's *tag*) a stored block enters, what a touch does (the table's
touch rules) and which lists an eviction takes from. Everything else
(reference counts, protection of the hashes a call names, atomicity, events,
counters) belongs to :class:`~kvoffload.manager.PolicyOffloadingManager`
and the table, and is written once. ``docs/block-table.md`` says what the
table does; ``docs/policies.md`` how to add a policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle
from kvoffload.table import BlockTable

#: what an eviction returns: the victims' hashes and their handles, in order
Victims = tuple[list[BlockHash], list[Handle]]


class EvictionPolicy(ABC):
    """Orders the resident blocks of ``table`` and chooses which to evict.

    Contract every policy keeps (checked by ``tests/core/test_contract.py``
    and the state machine in ``tests/core/test_state_machine.py``):

    * :meth:`seed` is called once, before anything else, with the blocks
      already resident (another policy's :meth:`ordered_items`, or none);
      it takes them over and sets the table's touch rules if the defaults
      (LRU within each list, restored by the manager first) are not its;
    * :meth:`insert` adds newly allocated blocks (their stores in flight);
    * ``evict(n, protected)`` is all-or-nothing: it returns exactly ``n``
      victims, none pinned, in flight or in ``protected``, taken out of the
      table; or ``None``, changing nothing. The table's ``evict`` gives
      this, O(log n) per victim however many blocks are busy;
    * ``evictions`` counts the victims returned, by the list they left;
    * :meth:`ordered_items` yields every resident block, least valuable
      first.
    """

    #: the name users select the policy by (``"lru"``, ``"arc"``...)
    name: ClassVar[str]
    #: names of the lists whose sizes :meth:`list_sizes` reports
    list_names: ClassVar[tuple[str, ...]]
    #: the table tags this policy files resident blocks under, the tag
    #: evicted first first (:meth:`ordered_items` reads them in this order)
    resident_tags: ClassVar[tuple[int, ...]]

    def __init__(self, capacity: int, table: BlockTable) -> None:
        self.capacity = capacity
        self.table = table
        #: touches that hit a ghost entry, by ghost list name
        self.ghost_hits: dict[str, int] = {}
        #: blocks evicted, by the list they were evicted from
        self.evictions: dict[str, int] = {}

    @abstractmethod
    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        """Take over the resident blocks ``items`` (first to be evicted
        first) and set the table's touch rules if the defaults are not
        this policy's."""

    @abstractmethod
    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        """File newly allocated blocks (not yet in the table)."""

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Record a use of the blocks; the first hash ends most recent. The
        default applies the table's touch rules."""
        self.table.touch(block_hashes)

    @abstractmethod
    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        """Remove and return ``n`` evictable blocks, or ``None`` (no change)."""

    def ordered_items(self) -> list[tuple[BlockHash, Handle]]:
        """Every resident block, first to be evicted first."""
        table = self.table
        return [item for tag in self.resident_tags for item in table.items(tag)]

    @abstractmethod
    def list_sizes(self) -> dict[str, int]:
        """Size of each list named in :attr:`list_names`."""

    def params(self) -> dict[str, float]:
        """The policy's adaptive parameters (for stats and metrics)."""
        return {}

    def clear_ghosts(self) -> None:
        """Forget history kept for blocks that are no longer resident."""
        return
