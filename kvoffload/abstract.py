"""Protocol types of the offloading manager (vLLM 0.11.2 ``kv_offload.abstract``).

The scheduler side of an engine talks to an :class:`OffloadingManager` with a
handful of verbs; the manager answers with :class:`LoadStoreSpec` objects that
a worker-side :class:`~kvoffload.transfer.OffloadingHandler` turns into copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NewType, Protocol, runtime_checkable

__all__ = [
    "BlockHash",
    "LoadStoreSpec",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "SupportsHints",
]

#: A chained block hash: it names a block's tokens *and* every token before it.
BlockHash = NewType("BlockHash", bytes)


class LoadStoreSpec(ABC):
    """Where blocks live on one medium; handlers read it to move data."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name, e.g. ``"CPU"`` or ``"GPU"``."""


@dataclass
class PrepareStoreOutput:
    """Answer of :meth:`OffloadingManager.prepare_store`."""

    block_hashes_to_store: list[BlockHash]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[BlockHash]


@dataclass
class OffloadingEvent:
    """Blocks that were stored on (``removed=False``) or removed from a medium."""

    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """The scheduler-side offloading protocol.

    Block life cycle: allocated by ``prepare_store`` (store in flight, not
    readable) -> ``complete_store`` (resident, evictable) -> ``prepare_load``
    pins (+1) ... ``complete_load`` unpins (-1). Only unpinned, resident blocks
    are ever evicted.
    """

    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Length of the longest prefix of ``block_hashes`` that is resident
        and ready to load. Changes nothing."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin the blocks for reading and say where they are. Every block must
        be resident and ready."""

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark the blocks as used; the first hash ends most recent."""
        return

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin blocks pinned by :meth:`prepare_load`."""
        return

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Allocate room for the blocks not yet present, evicting if needed.
        ``None`` when there is no room, and then nothing changed."""

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Mark stored blocks readable, or (``success=False``) forget the ones
        whose store was still in flight."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Drain the store/remove events gathered since the last call."""
        return ()


@runtime_checkable
class SupportsHints(Protocol):
    """A manager that can be told what the requests waiting to be served
    will use (kvoffload's managers are; vLLM's 0.11.2 managers are not).

    Not part of :class:`OffloadingManager`: that is vLLM's interface, and
    code written against it must keep working. Nor is there a default: a
    ``hint`` that handed out tickets and dropped the hints would make a
    scheduler believe it was heard. Check with ``isinstance(m,
    SupportsHints)``.

    Contract (``PolicyOffloadingManager.hint`` says it in full): ``hint``
    appends one waiting request to the window, in queue order, and returns
    its ticket; ``unhint`` removes it when it leaves the queue (served,
    aborted, preempted), in any order, and raises
    :class:`~kvoffload.errors.UnknownTicketError` for a ticket not in the
    window. Hints change no answer by themselves; a policy may use them to
    choose victims.
    """

    def hint(self, block_hashes: Iterable[BlockHash]) -> int:
        """A waiting request joins the window; returns its ticket."""
        ...

    def unhint(self, ticket: int) -> None:
        """The request of ``ticket`` left the waiting queue."""
        ...
