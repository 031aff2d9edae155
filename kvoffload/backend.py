"""Block backends: where a manager's blocks physically live (vLLM ``kv_offload.backend``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from kvoffload.abstract import BlockHash, LoadStoreSpec

__all__ = ["Backend", "BlockStatus", "Handle"]


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


#: What a manager keeps per resident block: whatever its backend's
#: :meth:`Backend.allocate_handles` hands out (a :class:`BlockStatus` for a
#: vLLM-style backend, a plain ``int`` block id for :class:`CPUBackend`).
#: Reference counts are not in it: the manager keeps them, for busy blocks only.
Handle = Any


class Backend(ABC):
    """Allocates and frees blocks on one medium and describes them as specs.

    A subclass implements vLLM's four methods (:meth:`allocate_blocks`,
    :meth:`free`, :meth:`get_load_store_spec`, :meth:`get_num_free_blocks`).
    The manager talks to it through the *handle* methods below, whose
    defaults use those four with :class:`BlockStatus` objects as handles; a
    backend overrides them to hand out something smaller (see
    :class:`~kvoffload.backends.cpu.CPUBackend`).
    """

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

    # -- what the manager uses --------------------------------------------

    def allocate_handles(self, block_hashes: list[BlockHash]) -> list[Handle]:
        """One handle per hash (the caller guarantees there is room)."""
        return self.allocate_blocks(block_hashes)

    def free_handles(self, handles: Iterable[Handle]) -> None:
        """Give back the space of these handles' blocks."""
        self.free_blocks(handles)

    def get_handles_spec(
        self, block_hashes: Sequence[BlockHash], handles: Sequence[Handle]
    ) -> LoadStoreSpec:
        """:meth:`get_load_store_spec` for handles."""
        return self.get_load_store_spec(block_hashes, handles)

    def block_status(self, handle: Handle, ref_cnt: int) -> BlockStatus:
        """The :class:`BlockStatus` of a handle's block with this reference
        count (what :meth:`~kvoffload.manager.PolicyOffloadingManager.get_block`
        answers)."""
        status: BlockStatus = handle
        status.ref_cnt = ref_cnt
        return status
