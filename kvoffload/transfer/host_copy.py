"""Row copies between two CPU tensors, batched by the shape of the job.

Every strategy moves each planned row once (no staging pass); they differ in
what one call costs and whether torch's intra-op threads share the bytes.
Measured on a 2-core x86 VM (torch 2.13, numpy 2.4, one thread): a slice
assignment between two byte ``memoryview``\\ s costs ~0.09 us of overhead and
moves at memcpy speed, a numpy fancy-index assignment ~1.5 us, a torch call
~3.5 us; ``torch.index_select(out=)`` gathers into a contiguous destination
at memcpy speed and numpy ``dst[idx] = src[a:b]`` scatters from a contiguous
source at memcpy speed. Torch copies of at least :data:`PARALLEL_MIN_BYTES`
are split over ``torch.get_num_threads()`` threads, the only way a job gets
more than one core. So a job runs as whichever of these is cheapest under a
cost model of calls x per-call cost (in bytes one could have copied
meanwhile) + bytes moved / parallel speed-up:

- ``bytes``: every run where both sides are consecutive copied with
  ``memcpy`` by one call of the C row copier (``kvoffload.transfer._rows``,
  a few nanoseconds a run); where that extension was not built (or
  ``KVOFFLOAD_PURE_PYTHON`` is set), one ``memoryview`` slice copy per run;
- ``pair``: one torch ``copy_`` per such run (for long runs with threads);
- ``gather``: one ``index_select(out=)`` per run of consecutive destination rows;
- ``scatter``: one numpy fancy assignment per run of consecutive source rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.transfer import _native
from kvoffload.transfer.block_map import CopyPlan

__all__ = ["HostCopier", "RowPair", "Strategy", "c_copy_rows"]

RowCopier = Callable[
    [memoryview, memoryview, npt.NDArray[np.int64], npt.NDArray[np.int64], int], int
]


#: The C row copier (``copy_rows(src, dst, src_rows, dst_rows, row_bytes)``),
#: or ``None`` where it was not built or ``KVOFFLOAD_PURE_PYTHON`` is set.
c_copy_rows: RowCopier | None = None if _native.rows is None else _native.rows.copy_rows

Strategy = Literal["bytes", "pair", "gather", "scatter"]

#: Per-call overheads, in bytes of copying they cost (~0.09/1.5/3.5 us at
#: ~45 GB/s, measured on a 2-core x86 VM with torch 2.13 and numpy 2.4); a run
#: of the C row copier costs a ``memcpy`` call and a few compares.
BYTES_CALL_BYTES = 4 * 1024
C_RUN_BYTES = 256
NUMPY_FANCY_CALL_BYTES = 64 * 1024
TORCH_CALL_BYTES = 144 * 1024
#: Torch splits a copy over its threads only above its grain size (32768
#: elements, 256 KiB of int64 words); smaller calls run on one thread.
PARALLEL_MIN_BYTES = 256 * 1024
#: Speed-up per extra thread of a parallel torch copy (in cache ~0.8, memory
#: bound less); kept low so that a busy machine does not pay for the model.
PARALLEL_GAIN = 0.5


def _numpy_view(t: torch.Tensor) -> npt.NDArray[np.generic] | None:
    """A numpy array sharing ``t``'s memory, or ``None`` (e.g. bfloat16)."""
    if t.device.type != "cpu" or t.requires_grad:
        return None
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


def _byte_view(t: torch.Tensor) -> memoryview | None:
    """A flat byte ``memoryview`` of ``t``'s memory, or ``None`` when ``t`` is
    not a contiguous CPU tensor (its rows are then not byte ranges)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dim() == 0:
        return None
    try:
        return t.detach().view(torch.uint8).reshape(-1).numpy().data
    except (TypeError, RuntimeError):  # pragma: no cover - uint8 always maps
        return None


@dataclass(frozen=True, slots=True)
class RowPair:
    """A source and a destination tensor (rows on dim 0, same dtype and row
    shape) with what choosing a strategy needs, computed once."""

    src: torch.Tensor
    dst: torch.Tensor
    src_np: npt.NDArray[np.generic] | None
    dst_np: npt.NDArray[np.generic] | None
    src_bytes: memoryview | None
    dst_bytes: memoryview | None
    row_bytes: int
    dst_contiguous: bool

    @classmethod
    def of(cls, src: torch.Tensor, dst: torch.Tensor) -> RowPair:
        """Precondition: ``src.shape[1:] == dst.shape[1:]`` and equal dtypes."""
        row_bytes = (src.numel() // max(1, src.shape[0])) * src.element_size()
        return cls(
            src,
            dst,
            _numpy_view(src),
            _numpy_view(dst),
            _byte_view(src),
            _byte_view(dst),
            row_bytes,
            dst.is_contiguous(),
        )


def _torch_cost(calls: int, nbytes: int, threads: int) -> float:
    """Cost of ``calls`` torch copies moving ``nbytes`` in all."""
    speed = 1.0
    if threads > 1 and nbytes >= calls * PARALLEL_MIN_BYTES:
        speed += PARALLEL_GAIN * (threads - 1)
    return calls * TORCH_CALL_BYTES + nbytes / speed


class HostCopier:
    """Copies planned rows from ``pair.src`` to ``pair.dst``, both on CPU.

    ``row_copier`` is what the ``bytes`` strategy calls: by default the C
    row copier where it was built (:data:`c_copy_rows`); ``None`` for the
    pure-Python loop (tests run both)."""

    def __init__(self, row_copier: RowCopier | None = c_copy_rows) -> None:
        #: How many copies ran with each strategy (for tests and benchmarks).
        self.counts: dict[Strategy, int] = {"bytes": 0, "pair": 0, "gather": 0, "scatter": 0}
        self.row_copier = row_copier
        self._run_bytes = BYTES_CALL_BYTES if row_copier is None else C_RUN_BYTES

    def choose(self, pair: RowPair, plan: CopyPlan, threads: int | None = None) -> Strategy:
        """The cheapest strategy for ``plan`` on ``pair`` with ``threads``
        torch threads (default: ``torch.get_num_threads()``)."""
        if threads is None:
            threads = torch.get_num_threads()
        nbytes = plan.num_rows * pair.row_bytes
        direct = pair.src_bytes is not None and pair.dst_bytes is not None
        if (
            direct
            and self.row_copier is not None
            and (threads == 1 or nbytes < PARALLEL_MIN_BYTES)
            and plan.num_rows * C_RUN_BYTES <= NUMPY_FANCY_CALL_BYTES
        ):
            # Without a parallel speed-up every other strategy costs at least
            # one numpy or torch call more than the bytes: the C copier at
            # one run per row is no dearer, so counting the runs would only
            # cost time (a few us, a tenth of a 1 MiB job).
            return "bytes"
        best: Strategy = "pair"
        cost = _torch_cost(plan.num_runs, nbytes, threads)
        if direct:
            by_bytes = plan.num_runs * self._run_bytes + nbytes
            if by_bytes <= cost:
                best, cost = "bytes", by_bytes
        # The one-sided strategies need run counts that cost a few numpy
        # calls; skip them when even one call would cost more than ``cost``.
        if pair.dst_contiguous and cost > TORCH_CALL_BYTES + nbytes / max(1, threads):
            gather = _torch_cost(plan.num_dst_runs, nbytes, threads)
            if gather < cost:
                best, cost = "gather", gather
        if (
            pair.src_np is not None
            and pair.dst_np is not None
            and cost > NUMPY_FANCY_CALL_BYTES + nbytes
        ):
            scatter = plan.num_src_runs * NUMPY_FANCY_CALL_BYTES + nbytes
            if scatter < cost:
                best, cost = "scatter", scatter
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
            return strategy or "bytes"
        chosen = strategy or self.choose(pair, plan)
        self.counts[chosen] += 1
        src, dst = pair.src, pair.dst
        if chosen == "bytes":
            src_b, dst_b = pair.src_bytes, pair.dst_bytes
            if src_b is None or dst_b is None:
                raise ValueError("the bytes strategy needs two contiguous CPU tensors")
            if self.row_copier is not None:
                self.row_copier(src_b, dst_b, plan.src, plan.dst, pair.row_bytes)
            else:
                for s0, s1, d0 in zip(*plan.byte_runs(pair.row_bytes), strict=True):
                    dst_b[d0 : d0 + s1 - s0] = src_b[s0:s1]
        elif chosen == "pair":
            for s, d, k in plan.runs.tolist():
                dst.narrow(0, d, k).copy_(src.narrow(0, s, k))
        elif chosen == "gather":
            src_idx = torch.from_numpy(plan.src)
            for p, k in plan.dst_runs.tolist():
                d0 = int(plan.dst[p])
                torch.index_select(src, 0, src_idx.narrow(0, p, k), out=dst.narrow(0, d0, k))
        else:
            src_np, dst_np = pair.src_np, pair.dst_np
            if src_np is None or dst_np is None:
                raise ValueError("the scatter strategy needs numpy views of both tensors")
            for p, k in plan.src_runs.tolist():
                s0 = int(plan.src[p])
                dst_np[plan.dst[p : p + k]] = src_np[s0 : s0 + k]
        return chosen
