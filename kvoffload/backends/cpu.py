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

    There is one :class:`CPUBlockStatus` per block id, made on the id's first
    allocation and handed out again (reset to in flight) each time the id is
    reused: allocation on a full cache is a list slice, not an object per
    block. A status object therefore describes a block only while that
    block is resident; do not keep one past the block's eviction.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        super().__init__(block_size=block_size, medium=CPULoadStoreSpec.medium())
        self.num_blocks: int = num_blocks
        self.num_allocated_blocks: int = 0
        # freed blocks, most recently freed last
        self._free: list[CPUBlockStatus] = []

    @property
    def allocated_blocks_free_list(self) -> list[int]:
        """Ids of the freed blocks, the next to be reused last (vLLM's field)."""
        return [b.block_id for b in self._free]

    def get_num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self.num_allocated_blocks

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
            free = self._free
            # last in, first out: the most recently freed block goes first
            reused = free[: -reuse - 1 : -1]
            del free[-reuse:]
            for b in reused:
                b.ref_cnt = -1
            blocks += reused
        return blocks

    def free(self, block: BlockStatus) -> None:
        if not isinstance(block, CPUBlockStatus):
            raise BlockStateError(f"not a block of this backend: {block!r}")
        self._free.append(block)

    def free_blocks(self, blocks: Iterable[BlockStatus]) -> None:
        self._free += blocks  # type: ignore[arg-type]

    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]
    ) -> CPULoadStoreSpec:
        return CPULoadStoreSpec.from_id_list([b.block_id for b in blocks])  # type: ignore[attr-defined]
