"""Block backends: where a manager's blocks physically live (vLLM ``kv_offload.backend``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from kvoffload.abstract import BlockHash, LoadStoreSpec


class BlockStatus:
    """State of one offloaded block.

    ``ref_cnt`` is -1 while the block's store is in flight, 0 when resident and
    evictable, and > 0 while loads are reading it. A plain slotted object
    rather than vLLM's ``ctypes.Structure``: same fields, about 40% of the
    memory and faster attribute access.
    """

    __slots__ = ("ref_cnt",)

    def __init__(self) -> None:
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        """Whether the block's data is fully stored and may be read."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ref_cnt={self.ref_cnt})"


class Backend(ABC):
    """Allocates and frees blocks on one medium and describes them as specs."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium

    @abstractmethod
    def get_num_free_blocks(self) -> int:
        """How many blocks can be allocated right now."""

    @abstractmethod
    def allocate_blocks(self, block_hashes: list[BlockHash]) -> list[BlockStatus]:
        """Allocate one block per hash. The caller guarantees there is room."""

    @abstractmethod
    def free(self, block: BlockStatus) -> None:
        """Return a block's space to the backend."""

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        """Free several blocks, in order (backends may do it in one go)."""
        for block in blocks:
            self.free(block)

    @abstractmethod
    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]
    ) -> LoadStoreSpec:
        """Describe where ``blocks`` are, for a transfer handler."""
