"""Row copies between two CPU tensors, batched by the shape of the job.

Measured on CPU (single thread, int64 rows): a torch call costs ~2.5 us of
dispatch; ``torch.index_select(out=)`` gathers into a contiguous destination
at memcpy speed; numpy fancy assignment ``dst[idx] = src[a:b]`` scatters from
a contiguous source at memcpy speed, while ``Tensor.index_copy_`` manages
about a third of that and a gather into a fresh temporary pays page faults.
So a job is run as whichever of these is cheapest under a simple cost model
(calls x :data:`OP_COST_BYTES` + bytes moved):

- ``pair``: one slice copy per run where both sides are consecutive;
- ``gather``: one ``index_select(out=)`` per run of consecutive destination rows;
- ``scatter``: one numpy assignment per run of consecutive source rows;
- ``staged``: gather a cache-sized chunk into a reused staging buffer, scatter
  it with numpy; two passes, but the second one hits cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.transfer.block_map import CopyPlan

__all__ = ["OP_COST_BYTES", "STAGING_BYTES", "HostCopier", "RowPair", "Strategy"]

Strategy = Literal["pair", "gather", "scatter", "staged"]

#: One library call costs about as much as moving this many bytes.
OP_COST_BYTES = 64 * 1024
#: Staging chunk size: small enough to stay in L2/L3 between the two passes.
STAGING_BYTES = 1 << 20


def _numpy_view(t: torch.Tensor) -> npt.NDArray[np.generic] | None:
    """A numpy array sharing ``t``'s memory, or ``None`` (e.g. bfloat16)."""
    if t.device.type != "cpu" or t.requires_grad:
        return None
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


@dataclass(frozen=True, slots=True)
class RowPair:
    """A source and a destination tensor (rows on dim 0, same dtype and row
    shape) with what choosing a strategy needs, computed once."""

    src: torch.Tensor
    dst: torch.Tensor
    src_np: npt.NDArray[np.generic] | None
    dst_np: npt.NDArray[np.generic] | None
    row_bytes: int
    dst_contiguous: bool

    @classmethod
    def of(cls, src: torch.Tensor, dst: torch.Tensor) -> RowPair:
        """Precondition: ``src.shape[1:] == dst.shape[1:]`` and equal dtypes."""
        row_bytes = (src.numel() // max(1, src.shape[0])) * src.element_size()
        return cls(src, dst, _numpy_view(src), _numpy_view(dst), row_bytes, dst.is_contiguous())


class HostCopier:
    """Copies planned rows from ``pair.src`` to ``pair.dst``, both on CPU.

    Holds one staging buffer per row shape, so an instance is not
    thread-safe; handlers are driven from one thread.
    """

    def __init__(self) -> None:
        self._staging: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        #: How many copies ran with each strategy (for tests and benchmarks).
        self.counts: dict[Strategy, int] = {"pair": 0, "gather": 0, "scatter": 0, "staged": 0}

    @staticmethod
    def choose(pair: RowPair, plan: CopyPlan) -> Strategy:
        """The cheapest strategy for ``plan`` on ``pair``."""
        data = plan.num_rows * pair.row_bytes
        best: Strategy = "pair"
        cost = plan.num_runs * OP_COST_BYTES + data
        if pair.dst_contiguous:
            gather = plan.num_dst_runs * OP_COST_BYTES + data
            if gather < cost:
                best, cost = "gather", gather
        if pair.src_np is not None and pair.dst_np is not None:
            scatter = plan.num_src_runs * OP_COST_BYTES + data
            if scatter < cost:
                best, cost = "scatter", scatter
            chunks = -(-data // STAGING_BYTES)
            staged = 2 * chunks * OP_COST_BYTES + data + data // 2
            if staged < cost:
                best, cost = "staged", staged
        return best

    def copy(self, pair: RowPair, plan: CopyPlan, strategy: Strategy | None = None) -> Strategy:
        """Copy row ``plan.src[i]`` of ``pair.src`` to row ``plan.dst[i]`` of
        ``pair.dst``.

        Preconditions: indices in range and no repeated destination row (both
        guaranteed by :func:`~kvoffload.transfer.block_map.plan_copy`). Rows of
        the destination not named by the plan are left untouched. ``strategy``
        forces one (tests use it to cover each); returns the one used.
        """
        if plan.num_rows == 0:
            return strategy or "pair"
        chosen = strategy or self.choose(pair, plan)
        self.counts[chosen] += 1
        src, dst = pair.src, pair.dst
        if chosen == "pair":
            for s, d, k in plan.runs.tolist():
                dst.narrow(0, d, k).copy_(src.narrow(0, s, k))
        elif chosen == "gather":
            src_idx = torch.from_numpy(plan.src)
            for p, k in plan.dst_runs.tolist():
                d0 = int(plan.dst[p])
                torch.index_select(src, 0, src_idx.narrow(0, p, k), out=dst.narrow(0, d0, k))
        elif chosen == "scatter":
            src_np, dst_np = pair.src_np, pair.dst_np
            assert src_np is not None and dst_np is not None
            for p, k in plan.src_runs.tolist():
                s0 = int(plan.src[p])
                dst_np[plan.dst[p : p + k]] = src_np[s0 : s0 + k]
        else:
            self._staged(pair, plan)
        return chosen

    def _staged(self, pair: RowPair, plan: CopyPlan) -> None:
        src, dst_np = pair.src, pair.dst_np
        assert dst_np is not None
        row_shape = tuple(src.shape[1:])
        key = (src.dtype, row_shape)
        staging = self._staging.get(key)
        if staging is None:
            rows = max(1, STAGING_BYTES // max(1, pair.row_bytes))
            staging = torch.empty((rows, *row_shape), dtype=src.dtype)
            self._staging[key] = staging
        staging_np = _numpy_view(staging)
        assert staging_np is not None
        src_idx = torch.from_numpy(plan.src)
        step = staging.shape[0]
        for p in range(0, plan.num_rows, step):
            k = min(step, plan.num_rows - p)
            torch.index_select(src, 0, src_idx.narrow(0, p, k), out=staging.narrow(0, 0, k))
            dst_np[plan.dst[p : p + k]] = staging_np[:k]
