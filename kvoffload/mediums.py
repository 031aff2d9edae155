"""Load/store specs that name blocks by id on a medium (vLLM ``kv_offload.mediums``)."""

from __future__ import annotations

from abc import ABC
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from kvoffload.abstract import LoadStoreSpec


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec holding block ids as a ``numpy.int64`` array."""

    def __init__(self, block_ids: Iterable[int] | npt.NDArray[np.int64]) -> None:
        if not isinstance(block_ids, np.ndarray):
            block_ids = list(block_ids)
        self.block_ids: npt.NDArray[np.int64] = np.asarray(block_ids, dtype=np.int64).reshape(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()!r})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the engine's GPU KV cache."""

    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the CPU tier."""

    @staticmethod
    def medium() -> str:
        return "CPU"
