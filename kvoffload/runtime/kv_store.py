"""The engine's "GPU" side: per-layer KV tensors and a small prefix cache over them.

Tensors use vLLM's layouts (``(num_blocks, ...)`` or ``(2, num_blocks, ...)``)
on CUDA when present, else on the CPU. Block contents are a deterministic
function of the block's hash, so any block that comes back from the CPU tier
can be checked byte for byte (:meth:`GPUKVStore.verify`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvoffload._checks import is_int
from kvoffload.abstract import BlockHash
from kvoffload.errors import ConfigError
from kvoffload.runtime.config import DTYPES, _is_device_name
from kvoffload.transfer.cpu_gpu import DEFAULT_RAM_FRACTION, default_max_cpu_bytes
from kvoffload.transfer.layout import Layout

__all__ = ["GPUKVStore", "block_pattern", "hash_seed"]

_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def hash_seed(block_hash: bytes) -> int:
    """A 56-bit integer derived from a block hash (fits int64 arithmetic)."""
    return int.from_bytes(block_hash[:7], "little")


def block_pattern(seeds: torch.Tensor, width: int, salt: int) -> torch.Tensor:
    """``(len(seeds), width)`` int32 contents for blocks with these seeds.

    A cheap integer mix: every block, layer (``salt``) and position gets a
    different word, so a block copied to the wrong place is caught.
    """
    j = torch.arange(width, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] * 0x9E3779B1 + j[None, :] * 0x85EBCA77 + (salt + 1) * 0xC2B2AE3D
    x = x ^ (x >> 29)
    return x.to(torch.int32)


def _usable_device(device: str) -> str:
    """``device`` resolved (``auto``) and checked against this machine: a
    :class:`ConfigError` names what is wrong instead of a CUDA error later."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if not _is_device_name(device):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:n]', got {device!r}")
    index = device.removeprefix("cuda:")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"device {device!r} is not available: no CUDA device found; use 'cpu' or 'auto'"
        )
    if device != "cuda" and int(index) >= count:
        raise ConfigError(
            f"device {device!r} is not available: this machine has {count} CUDA "
            f"device(s), cuda:0 to cuda:{count - 1}"
        )
    return device


class GPUKVStore:
    """KV tensors of ``num_blocks`` GPU blocks plus a prefix cache over them.

    A block is *free* (no content), *cached* (content for a hash, evictable,
    in LRU order) or *pinned* (in use by the current request or a transfer
    job in flight). Cached blocks are reused when free ones run out.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str = "float16",
        layout: Layout = "kv_first",
        device: str = "auto",
    ) -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        for name, v in (
            ("num_gpu_blocks", num_blocks),
            ("gpu_block_size", block_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_size", head_size),
        ):
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        device = _usable_device(device)
        tdtype = _DTYPES[dtype]
        per_block = block_size * num_kv_heads * head_size * tdtype.itemsize
        if per_block % 4:
            raise ConfigError(
                "block_size * num_kv_heads * head_size * dtype size must be a multiple of 4 bytes"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout
        self.device = torch.device(device)
        if layout == "kv_first":
            shape = (2, num_blocks, block_size, num_kv_heads, head_size)
        elif layout == "blocks_first":
            shape = (num_blocks, 2, block_size, num_kv_heads, head_size)
        else:
            raise ConfigError(f"layout must be 'kv_first' or 'blocks_first', got {layout!r}")
        need = 2 * per_block * num_blocks * num_layers
        limit = default_max_cpu_bytes() if self.device.type == "cpu" else None
        if limit is not None and need > limit:
            raise ConfigError(
                f"the simulated GPU KV cache needs {need} bytes ({num_blocks} GPU blocks x "
                f"{num_layers} layers x 2 x {per_block} bytes) on the CPU, above {limit} "
                f"({DEFAULT_RAM_FRACTION:.0%} of this machine's memory); lower the GPU blocks "
                "or layers (kvoffload serve: --gpu-blocks / KVOFFLOAD_GPU_BLOCKS, --num-layers "
                "/ KVOFFLOAD_NUM_LAYERS)"
            )
        try:
            self.tensors: dict[str, torch.Tensor] = {
                f"layer.{i}": torch.zeros(shape, dtype=tdtype, device=self.device)
                for i in range(num_layers)
            }
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"cannot allocate the simulated GPU KV cache ({need} bytes on {device}): {e}; "
                "lower the GPU blocks or layers (kvoffload serve: --gpu-blocks / "
                "KVOFFLOAD_GPU_BLOCKS, --num-layers / KVOFFLOAD_NUM_LAYERS)"
            ) from e
        # int32 block-major views: one per layer (blocks_first) or two (K, V).
        self._rows: list[torch.Tensor] = []
        for t in self.tensors.values():
            if layout == "kv_first":
                self._rows.extend(t[i].reshape(num_blocks, -1).view(torch.int32) for i in range(2))
            else:
                self._rows.append(t.reshape(num_blocks, -1).view(torch.int32))
        #: bytes of one GPU block over all layers
        self.block_bytes = (
            sum(t.numel() * t.element_size() for t in self.tensors.values()) // num_blocks
        )
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()  # evictable, LRU first
        self._pinned: dict[BlockHash, int] = {}  # hash -> block id
        self._pins: list[int] = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks

    # -- prefix cache ----------------------------------------------------

    def prefix_hit(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading ``hashes`` whose blocks are on the GPU."""
        n = 0
        for h in hashes:
            if h not in self._cached and h not in self._pinned:
                break
            n += 1
        return n

    def pin_cached(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin blocks known to be present (from :meth:`prefix_hit`); their ids."""
        ids = []
        for h in hashes:
            bid = self._cached.pop(h, None)
            if bid is None:
                bid = self._pinned[h]
            else:
                self._pinned[h] = bid
            self._pins[bid] += 1
            ids.append(bid)
        return ids

    def available(self) -> int:
        """Blocks that :meth:`allocate` could hand out now."""
        return len(self._free) + len(self._cached)

    def allocate(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pinned blocks for ``hashes`` (past the prefix hit), reusing the least
        recently used cached blocks when no free ones are left. The caller
        checks :meth:`available` first.

        A hash past the prefix hit may still own a block (a later block of a
        chain whose earlier block was evicted): that block is reused, so no
        hash ever owns two blocks (the second one would leak)."""
        ids = []
        for h in hashes:
            bid = self._cached.pop(h, None)
            if bid is None and h in self._pinned:
                bid = self._pinned[h]
            if bid is not None:
                self._pinned[h] = bid
                self._pins[bid] += 1
                ids.append(bid)
                continue
            if self._free:
                bid = self._free.pop()
            else:
                _, bid = self._cached.popitem(last=False)
            self._hash_of[bid] = h
            self._pinned[h] = bid
            self._pins[bid] = 1
            ids.append(bid)
        return ids

    def pin(self, ids: Sequence[int]) -> None:
        """Add a pin to blocks that are already pinned (e.g. read by a job)."""
        for bid in ids:
            assert self._pins[bid] > 0, "pin() is for blocks already in use"
            self._pins[bid] += 1

    def unpin(self, ids: Sequence[int]) -> None:
        """Release pins; a block whose last pin goes becomes cached (MRU)."""
        for bid in ids:
            self._pins[bid] -= 1
            if self._pins[bid] == 0:
                h = self._hash_of[bid]
                assert h is not None
                del self._pinned[h]
                self._cached[h] = bid

    def discard(self, ids: Sequence[int]) -> None:
        """Unpin blocks whose contents are invalid and free them."""
        for bid in ids:
            self._pins[bid] -= 1
            if self._pins[bid] == 0:
                h = self._hash_of[bid]
                assert h is not None
                del self._pinned[h]
                self._hash_of[bid] = None
                self._free.append(bid)

    def clear(self) -> int:
        """Drop every cached (unpinned) block; returns how many."""
        n = len(self._cached)
        for bid in self._cached.values():
            self._hash_of[bid] = None
            self._free.append(bid)
        self._cached.clear()
        return n

    @property
    def cached_blocks(self) -> int:
        return len(self._cached) + len(self._pinned)

    # -- contents ----------------------------------------------------------

    def _seeds(self, hashes: Sequence[BlockHash]) -> torch.Tensor:
        return torch.tensor([hash_seed(h) for h in hashes], dtype=torch.int64, device=self.device)

    def compute(self, ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """ "Compute" KV for blocks: write the contents their hashes determine."""
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        seeds = self._seeds(hashes)
        # index_copy_/index_select, not rows[idx]: on CPU tensors advanced
        # indexing costs milliseconds per call when the cores are busy.
        for salt, rows in enumerate(self._rows):
            rows.index_copy_(0, idx, block_pattern(seeds, rows.shape[1], salt))

    def verify(self, ids: Sequence[int], hashes: Sequence[BlockHash]) -> int:
        """Number of blocks whose contents differ from what their hashes determine."""
        if not ids:
            return 0
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        seeds = self._seeds(hashes)
        bad = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        for salt, rows in enumerate(self._rows):
            got = rows.index_select(0, idx)
            bad |= (got != block_pattern(seeds, rows.shape[1], salt)).any(dim=1)
        return int(bad.sum().item())
