"""Protocol types of the offloading manager (vLLM 0.11.2 ``kv_offload.abstract``).

The scheduler side of an engine talks to an :class:`OffloadingManager` with a
handful of verbs; the manager answers with :class:`LoadStoreSpec` objects that
a worker-side :class:`~kvoffload.transfer.OffloadingHandler` turns into copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NewType

__all__ = [
    "BlockHash",
    "LoadStoreSpec",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
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
