"""The CPU block backend (vLLM ``kv_offload.backends.cpu``)."""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.abstract import BlockHash
from kvoffload.backend import Backend, BlockStatus
from kvoffload.errors import BlockStateError, ConfigError
from kvoffload.mediums import CPULoadStoreSpec


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
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        super().__init__(block_size=block_size, medium=CPULoadStoreSpec.medium())
        self.num_blocks: int = num_blocks
        self.num_allocated_blocks: int = 0
        self.allocated_blocks_free_list: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self.allocated_blocks_free_list) + self.num_blocks - self.num_allocated_blocks

    def allocate_blocks(self, block_hashes: list[BlockHash]) -> list[BlockStatus]:
        n = len(block_hashes)
        if n > self.get_num_free_blocks():
            raise BlockStateError(
                f"cannot allocate {n} blocks: only {self.get_num_free_blocks()} free"
            )
        fresh = min(n, self.num_blocks - self.num_allocated_blocks)
        start = self.num_allocated_blocks
        blocks: list[BlockStatus] = list(map(CPUBlockStatus, range(start, start + fresh)))
        self.num_allocated_blocks = start + fresh
        reuse = n - fresh
        if reuse:
            free_list = self.allocated_blocks_free_list
            # last in, first out: the most recently freed id goes first
            blocks.extend(map(CPUBlockStatus, free_list[: -reuse - 1 : -1]))
            del free_list[-reuse:]
        return blocks

    def free(self, block: BlockStatus) -> None:
        assert isinstance(block, CPUBlockStatus)
        self.allocated_blocks_free_list.append(block.block_id)

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        self.allocated_blocks_free_list.extend([b.block_id for b in blocks])  # type: ignore[attr-defined]

    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]
    ) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([block.block_id for block in blocks])  # type: ignore[attr-defined]
