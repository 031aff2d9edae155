"""Load/store specs that name blocks by id on a medium (vLLM ``kv_offload.mediums``)."""

from __future__ import annotations

from abc import ABC
from collections.abc import Iterable
from typing import Self

import numpy as np
import numpy.typing as npt

from kvoffload.abstract import LoadStoreSpec

__all__ = ["BlockIDsLoadStoreSpec", "CPULoadStoreSpec", "GPULoadStoreSpec"]


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec holding block ids as a ``numpy.int64`` array."""

    def __init__(self, block_ids: Iterable[int] | npt.NDArray[np.int64]) -> None:
        """``block_ids``: integers (a sequence, any iterable, or an integer
        array; nested ones are flattened). Anything else raises
        :class:`ValueError` rather than being rounded or parsed: ``1.7`` as
        block 1, ``"3"`` as block 3 would copy the wrong block."""
        if not isinstance(block_ids, np.ndarray):
            block_ids = list(block_ids)
        given = np.asarray(block_ids)
        if given.size and (given.dtype.kind not in "iu"):
            raise ValueError(
                f"block ids must be integers, got {given.dtype} values "
                f"(e.g. {given.reshape(-1)[:1].tolist()[0]!r})"
            )
        self._ids: list[int] | None = None
        self._array: npt.NDArray[np.int64] | None = given.astype(np.int64).reshape(-1)

    @classmethod
    def from_id_list(cls, block_ids: list[int]) -> Self:
        """A spec over a list of ``int`` ids the caller hands over (and does
        not change afterwards): the array is built on first use of
        :attr:`block_ids`, so a manager answering ``prepare_store`` does not
        pay for it when nobody reads it (a replay, a dry run)."""
        spec = cls.__new__(cls)
        spec._ids = block_ids
        spec._array = None
        return spec

    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        """The block ids, a one-dimensional ``numpy.int64`` array."""
        array = self._array
        if array is None:
            array = self._array = np.array(self._ids, dtype=np.int64)
            self._ids = None
        return array

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
