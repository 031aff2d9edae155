"""The CPU block backend (vLLM ``kv_offload.backends.cpu``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvoffload._checks import is_int
from kvoffload.abstract import BlockHash
from kvoffload.backend import Backend, BlockStatus
from kvoffload.errors import BlockStateError, ConfigError
from kvoffload.mediums import CPULoadStoreSpec

__all__ = ["CPUBackend", "CPUBlockStatus"]


class CPUBlockStatus(BlockStatus):
    """A CPU block: its status plus its slot index in the CPU tier."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: int) -> None:
        self.ref_cnt = -1
        self.block_id = block_id

    def __repr__(self) -> str:
        return f"CPUBlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class CPUBackend(Backend):
    """``num_blocks`` slots of ``block_size`` tokens in CPU memory.

    Never-used block ids are handed out in ascending order first; freed ids
    are then reused last-in-first-out (exactly as vLLM 0.11.2 does, so block
    ids match between the two).

    A manager's handle for a CPU block is its ``int`` block id: no object
    per block beyond the id itself (``allocate_blocks`` still answers
    :class:`CPUBlockStatus` objects, as vLLM's does).
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        # bool is an int subclass: CPUBackend(True, True) was one block of one token
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        super().__init__(block_size=block_size, medium=CPULoadStoreSpec.medium())
        self.num_blocks: int = num_blocks
        self.num_allocated_blocks: int = 0
        #: freed ids, the next to be reused last (vLLM's field)
        self.allocated_blocks_free_list: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self.allocated_blocks_free_list) + self.num_blocks - self.num_allocated_blocks

    # -- handles: block ids -------------------------------------------------

    def allocate_handles(self, block_hashes: list[BlockHash]) -> list[int]:
        n = len(block_hashes)
        free_list = self.allocated_blocks_free_list
        if self.num_allocated_blocks == self.num_blocks:
            # the usual state once the tier has filled: freed ids only
            if n > len(free_list):
                raise BlockStateError(f"cannot allocate {n} blocks: only {len(free_list)} free")
            if not n:
                return []
            # last in, first out: the most recently freed id goes first
            ids = free_list[: -n - 1 : -1]
            del free_list[-n:]
            return ids
        if n > self.get_num_free_blocks():
            raise BlockStateError(
                f"cannot allocate {n} blocks: only {self.get_num_free_blocks()} free"
            )
        fresh = min(n, self.num_blocks - self.num_allocated_blocks)
        start = self.num_allocated_blocks
        ids = list(range(start, start + fresh))
        self.num_allocated_blocks = start + fresh
        reuse = n - fresh
        if reuse:
            ids += free_list[: -reuse - 1 : -1]
            del free_list[-reuse:]
        return ids

    def free_handles(self, handles: Iterable[int]) -> None:
        self.allocated_blocks_free_list += handles

    def get_handles_spec(
        self, block_hashes: Sequence[BlockHash], handles: Sequence[int]
    ) -> CPULoadStoreSpec:
        """A spec over ``handles``. A ``list`` is kept as it is, not copied:
        the manager hands over lists it made for the call and never changes
        afterwards (so should any other caller)."""
        return CPULoadStoreSpec.from_id_list(handles if type(handles) is list else list(handles))

    def block_status(self, handle: int, ref_cnt: int) -> CPUBlockStatus:
        status = CPUBlockStatus(handle)
        status.ref_cnt = ref_cnt
        return status

    # -- vLLM's interface ---------------------------------------------------

    def allocate_blocks(self, block_hashes: list[BlockHash]) -> list[BlockStatus]:
        return list(map(CPUBlockStatus, self.allocate_handles(block_hashes)))

    def free(self, block: BlockStatus) -> None:
        if not isinstance(block, CPUBlockStatus):
            raise BlockStateError(f"not a block of this backend: {block!r}")
        self.allocated_blocks_free_list.append(block.block_id)

    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]
    ) -> CPULoadStoreSpec:
        return CPULoadStoreSpec.from_id_list([b.block_id for b in blocks])  # type: ignore[attr-defined]
