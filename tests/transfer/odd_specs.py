"""Specs a handler must refuse without an error escaping: shared by the
block-map and the handler tests (a module of its own, as tests/app's
api_support is)."""

from __future__ import annotations

import numpy as np

from kvoffload.mediums import CPULoadStoreSpec
from kvoffload.transfer.block_map import PartialCPULoadStoreSpec

__all__ = ["UnreadableIds", "skipless"]


class UnreadableIds(CPULoadStoreSpec):
    """A spec whose ``block_ids`` raises when read."""

    @property
    def block_ids(self) -> np.ndarray:
        raise RuntimeError("block ids lost")


def skipless() -> PartialCPULoadStoreSpec:
    """A partial spec as the inherited ``from_id_list`` built it: no skips."""
    spec = PartialCPULoadStoreSpec([0])
    del spec.skip_first, spec.skip_last
    return spec
