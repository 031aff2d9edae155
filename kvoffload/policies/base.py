"""The eviction-policy seam.

A policy is a small ordered index of the resident blocks: it keeps the block
table (hash -> the backend's :data:`~kvoffload.backend.Handle`) in its own
order, reacts to ``touch`` and picks victims. Everything else (reference counts,
protection of the hashes a call names, atomicity, events, counters) belongs to
:class:`~kvoffload.manager.PolicyOffloadingManager` and is written once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import ClassVar

from kvoffload.abstract import BlockHash
from kvoffload.backend import Handle

#: ``(hash, handle)``, as ``OrderedDict.popitem`` returns it
Victim = tuple[BlockHash, Handle]


class EvictionPolicy(ABC):
    """Orders resident blocks and chooses which to evict.

    Contract every policy keeps (checked by ``tests/core/test_contract.py`` and
    the state machine in ``tests/core/test_state_machine.py``):

    * ``get``/``__contains__``/``__len__`` see exactly the inserted, not yet
      evicted or removed blocks;
    * ``evict(n, protected)`` is all-or-nothing: it returns exactly ``n``
      victims, none of them busy (in :attr:`busy`) or in ``protected``, and
      removes them; or it returns ``None`` and changes nothing;
    * ``evict`` costs amortised O(1) per victim even when most blocks are
      pinned or in flight: a non-evictable block the scan passes counts as
      in use (it *is*) and leaves the scanned order (it is parked until
      :meth:`released`, or moves to its list's most recent end), so later
      scans do not pass it again
      (:class:`~kvoffload.policies.recency.RecencyList` does this);
    * ``evictions`` counts the victims returned, by the list they left;
    * ``ordered_items`` yields every resident block, least valuable first;
      ``seed`` accepts that order from another policy (live switch).
    """

    #: the name users select the policy by (``"lru"``, ``"arc"``...)
    name: ClassVar[str]
    #: names of the lists whose sizes :meth:`list_sizes` reports
    list_names: ClassVar[tuple[str, ...]]

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: touches that hit a ghost entry, by ghost list name
        self.ghost_hits: dict[str, int] = {}
        #: blocks evicted, by the list they were evicted from
        self.evictions: dict[str, int] = {}
        #: reference counts of the busy blocks, kept by the manager (which
        #: sets this): ``-1`` while a block's store is in flight, ``> 0``
        #: while loads read it; a resident block not in it is evictable.
        #: Read-only for the policy.
        self.busy: Mapping[BlockHash, int] = {}

    @abstractmethod
    def get(self, block_hash: BlockHash) -> Handle | None:
        """The resident block with this hash, or ``None``."""

    @abstractmethod
    def __contains__(self, block_hash: object) -> bool: ...

    def get_idle(self, block_hash: BlockHash) -> Handle | None:
        """:meth:`get`, but only required to be right for a block that is
        not busy (the manager checks :attr:`busy` first). ``lookup`` calls
        it once per block: a policy that sets busy blocks aside can answer
        from its main table alone (LRU binds it to a C method)."""
        return self.get(block_hash)

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[Handle | None]:
        """:meth:`get` for each hash (one call; policies may do it faster)."""
        return list(map(self.get, block_hashes))

    def absent(self, block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """The hashes without a resident block, in order."""
        get = self.get
        return [h for h in block_hashes if get(h) is None]

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks (ghost entries excluded)."""

    @abstractmethod
    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[Handle]) -> None:
        """Add newly allocated blocks (not yet in the index) as most recent."""

    @abstractmethod
    def remove(self, block_hash: BlockHash) -> Handle | None:
        """Forget a block without remembering it (its store failed)."""

    @abstractmethod
    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Record a use of the blocks; the first hash ends most recent."""

    @abstractmethod
    def evict(self, n: int, protected: Container[BlockHash]) -> list[Victim] | None:
        """Remove and return ``n`` evictable blocks, or ``None`` (no change)."""

    @abstractmethod
    def ordered_items(self) -> Iterator[tuple[BlockHash, Handle]]:
        """Every resident block, first to be evicted first."""

    def seed(self, items: Iterable[tuple[BlockHash, Handle]]) -> None:
        """Fill an empty policy from another policy's :meth:`ordered_items`."""
        items = list(items)
        self.insert([h for h, _ in items], [b for _, b in items])

    @abstractmethod
    def list_sizes(self) -> dict[str, int]:
        """Size of each list named in :attr:`list_names`."""

    def stored(self, block_hashes: Sequence[BlockHash]) -> None:
        """The manager's notice that these blocks' stores completed: they
        are evictable now. The default hands them to :meth:`released`; a
        policy that never sets in-flight blocks aside overrides it with a
        no-op, which keeps it off the path of every store."""
        self.released(block_hashes)

    def released(self, block_hashes: Sequence[BlockHash]) -> None:
        """The manager's notice that these resident blocks just became
        evictable: their last load completed (and, through :meth:`stored`,
        their store did). A policy that set busy blocks aside takes them
        back."""
        return

    def params(self) -> dict[str, float]:
        """The policy's adaptive parameters (for stats and metrics)."""
        return {}

    def clear_ghosts(self) -> None:
        """Forget history kept for blocks that are no longer resident."""
        return
