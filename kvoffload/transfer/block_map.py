"""Which sub-block goes where: the block-mapping math of a transfer job.

A CPU-tier block holds ``factor`` consecutive GPU blocks ("sub-blocks"): CPU
block ``b`` covers rows ``b*factor .. b*factor+factor-1`` of the CPU mirror's
block dimension. A GPU block is one row of the GPU cache (factor 1).

This module is plain numpy so that the CUDA handler, the CPU-tensor path and
the in-memory fake share one implementation that is unit-testable without
torch; where ``kvoffload.transfer._rows`` was built, :func:`plan_copy` plans
a valid job in one C call and leaves every refusal to the numpy path.

Partial CPU blocks
------------------
Counts alone fix where a transfer may start or end inside a CPU block only up
to one convention. With plain specs, ``N`` GPU blocks and ``M`` CPU blocks,
the job is accepted iff ``0 <= M*factor - N < factor`` and the missing
``M*factor - N`` sub-blocks are skipped **at the start of the first CPU
block**, on either side. On a store that is vLLM 0.11.2's
``dst_sub_blocks_to_skip``; on a load it is the fix of vLLM's defect 7 (a GPU
prefix hit that ends inside an offloaded block: vLLM asserts, we skip the
head of the first source block).

A transfer that *ends* inside a CPU block cannot be told apart from one that
starts inside it by counts, so it must be said explicitly with
:class:`PartialCPULoadStoreSpec` (``skip_first``/``skip_last``). Every other
shape is refused with :class:`~kvoffload.errors.TransferError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Self

import numpy as np
import numpy.typing as npt

from kvoffload._checks import check_int, is_int
from kvoffload.abstract import LoadStoreSpec
from kvoffload.errors import TransferError
from kvoffload.mediums import CPULoadStoreSpec
from kvoffload.transfer._native import rows as _rows

logger = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
Direction = Literal["store", "load"]

__all__ = [
    "CopyPlan",
    "Direction",
    "PartialCPULoadStoreSpec",
    "TransferPlan",
    "admit_job",
    "consecutive_runs",
    "expand_block_ids",
    "plan_copy",
    "plan_transfer",
]


class PartialCPULoadStoreSpec(CPULoadStoreSpec):
    """CPU blocks of which only a middle part takes part in the transfer.

    The first ``skip_first`` sub-blocks of the first block and the last
    ``skip_last`` sub-blocks of the last block are left out (sub-block = one
    GPU block). Its medium is still ``"CPU"``, so a worker routes it like a
    :class:`~kvoffload.mediums.CPULoadStoreSpec`. A skip that is not an
    ``int >= 0`` raises :class:`~kvoffload.errors.ConfigError` (``2.9`` or
    ``True`` would skip sub-blocks nobody named); whether the skips fit the
    handler's block-size factor is checked when a job is planned.
    """

    def __init__(
        self,
        block_ids: Iterable[int] | IntArray,
        *,
        skip_first: int = 0,
        skip_last: int = 0,
    ) -> None:
        super().__init__(block_ids)
        self.skip_first = check_int("skip_first", skip_first, 0)
        self.skip_last = check_int("skip_last", skip_last, 0)

    @classmethod
    def from_id_list(cls, block_ids: list[int], *, skip_first: int = 0, skip_last: int = 0) -> Self:
        """:meth:`CPULoadStoreSpec.from_id_list
        <kvoffload.mediums.BlockIDsLoadStoreSpec.from_id_list>` with the skips
        of the constructor."""
        first, last = check_int("skip_first", skip_first, 0), check_int("skip_last", skip_last, 0)
        spec = super().from_id_list(block_ids)
        spec.skip_first, spec.skip_last = first, last
        return spec

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.block_ids.tolist()!r}, "
            f"skip_first={self.skip_first}, skip_last={self.skip_last})"
        )


def expand_block_ids(
    block_ids: IntArray, factor: int, skip_first: int = 0, skip_last: int = 0
) -> IntArray:
    """Sub-block rows covered by ``block_ids``, in order.

    Block ``b`` expands to ``b*factor .. b*factor+factor-1``; the first
    ``skip_first`` and last ``skip_last`` rows of the whole result are dropped.
    E.g. ``([0, 1, 3], 4, skip_first=1)`` gives ``[1, 2, 3, 4, 5, 6, 7, 12,
    13, 14, 15]``.

    Precondition (checked by :func:`plan_copy`, not here): the skips leave at
    least the rows they promise to leave.
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    if factor == 1:
        # A copy, so the plan never aliases (possibly read-only) spec arrays.
        rows = ids.copy()
    else:
        rows = (ids[:, None] * factor + np.arange(factor, dtype=np.int64)).reshape(-1)
    return rows[skip_first : rows.size - skip_last]


def _starts_and_lengths(breaks: IntArray, n: int) -> tuple[IntArray, IntArray]:
    """Runs of ``n`` items given the positions ``i`` after which a run breaks."""
    starts = np.empty(breaks.size + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = breaks + 1
    lengths = np.empty_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = n - starts[-1]
    return starts, lengths


def consecutive_runs(idx: IntArray) -> IntArray:
    """Maximal stretches where ``idx`` increases by exactly one.

    Returns an ``(R, 2)`` array of ``(position, length)``; the lengths sum to
    ``idx.size``.
    """
    n = idx.size
    if n < 2:
        # Tiny jobs are common; numpy's per-call cost would dominate them.
        return np.array([[0, n]] if n else [], dtype=np.int64).reshape(-1, 2)
    starts, lengths = _starts_and_lengths(np.flatnonzero(idx[1:] != idx[:-1] + 1), n)
    out = np.empty((starts.size, 2), dtype=np.int64)
    out[:, 0] = starts
    out[:, 1] = lengths
    return out


class CopyPlan:
    """Row ``src[i]`` of the source goes to row ``dst[i]`` of the destination.

    :attr:`runs` coalesces the pairs into ``(src_start, dst_start, length)``
    stretches where both sides are consecutive, so an executor can issue one
    slice copy per run instead of one per block; :attr:`src_runs` /
    :attr:`dst_runs` are the runs of one side (see :func:`consecutive_runs`).
    All are computed on first use from two shared break masks and cached, so
    every layer of a job reuses them and an executor pays only for the ones
    it uses (``num_*`` counts are cheaper still).
    """

    __slots__ = ("_cache", "_dst_breaks", "_src_breaks", "dst", "src")

    def __init__(self, src: IntArray, dst: IntArray) -> None:
        if src.shape != dst.shape:
            raise TransferError(f"a plan pairs equal counts, got {src.size} and {dst.size}")
        self.src = src
        self.dst = dst
        self._src_breaks: npt.NDArray[np.bool_] | None = None
        self._dst_breaks: npt.NDArray[np.bool_] | None = None
        self._cache: dict[str, Any] = {}

    @property
    def num_rows(self) -> int:
        """Number of sub-blocks copied."""
        return int(self.src.size)

    def _breaks(self) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """``breaks[i]``: row ``i+1`` does not follow row ``i`` on that side."""
        if self._src_breaks is None or self._dst_breaks is None:
            src, dst = self.src, self.dst
            self._src_breaks = (src[1:] - src[:-1]) != 1
            self._dst_breaks = (dst[1:] - dst[:-1]) != 1
        return self._src_breaks, self._dst_breaks

    def _count(self, key: str, mask: Callable[[], npt.NDArray[np.bool_]]) -> int:
        if key not in self._cache:
            n = self.src.size
            if n < 2:
                self._cache[key] = n
            else:
                self._cache[key] = 1 + int(np.count_nonzero(mask()))
        return int(self._cache[key])

    @property
    def num_runs(self) -> int:
        """``len(runs)``."""
        return self._count("num_runs", lambda: np.logical_or(*self._breaks()))

    @property
    def num_src_runs(self) -> int:
        """``len(src_runs)``."""
        return self._count("num_src_runs", lambda: self._breaks()[0])

    @property
    def num_dst_runs(self) -> int:
        """``len(dst_runs)``."""
        return self._count("num_dst_runs", lambda: self._breaks()[1])

    @property
    def runs(self) -> IntArray:
        """``(R, 3)`` array of ``(src_start, dst_start, length)``."""
        if "runs" not in self._cache:
            src, dst = self.src, self.dst
            n = src.size
            if n == 0:
                runs = np.empty((0, 3), dtype=np.int64)
            elif self.num_runs == 1:
                runs = np.array([[src[0], dst[0], n]], dtype=np.int64)
            else:
                brk = np.flatnonzero(np.logical_or(*self._breaks()))
                starts, lengths = _starts_and_lengths(brk, n)
                runs = np.empty((starts.size, 3), dtype=np.int64)
                runs[:, 0] = src[starts]
                runs[:, 1] = dst[starts]
                runs[:, 2] = lengths
            self._cache["runs"] = runs
        result: IntArray = self._cache["runs"]
        return result

    def byte_runs(self, row_bytes: int) -> tuple[list[int], list[int], list[int]]:
        """:attr:`runs` in bytes for rows of ``row_bytes``: three lists,
        ``src_start``, ``src_end`` and ``dst_start`` of each run, ready for
        ``zip`` in a loop of slice copies (no tuple per run is built).
        Cached per row size, so the layers of a job share them."""
        key = f"byte_runs:{row_bytes}"
        if key not in self._cache:
            n = self.src.size
            num_runs = self.num_runs
            out: tuple[list[int], list[int], list[int]]
            if num_runs == 0:
                out = ([], [], [])
            elif num_runs == 1:
                s0 = int(self.src[0]) * row_bytes
                out = ([s0], [s0 + n * row_bytes], [int(self.dst[0]) * row_bytes])
            elif num_runs == n:
                # Every row its own run (random ids): skip the run analysis.
                starts = self.src * row_bytes
                ends = starts + row_bytes
                out = (starts.tolist(), ends.tolist(), (self.dst * row_bytes).tolist())
            else:
                runs = self.runs * row_bytes
                ends = runs[:, 0] + runs[:, 2]
                out = (runs[:, 0].tolist(), ends.tolist(), runs[:, 1].tolist())
            self._cache[key] = out
        result: tuple[list[int], list[int], list[int]] = self._cache[key]
        return result

    def _side_runs(self, key: str, idx: IntArray, side: int) -> IntArray:
        if key not in self._cache:
            n = idx.size
            if n < 2:
                runs = np.array([[0, n]] if n else [], dtype=np.int64).reshape(-1, 2)
            else:
                starts, lengths = _starts_and_lengths(np.flatnonzero(self._breaks()[side]), n)
                runs = np.empty((starts.size, 2), dtype=np.int64)
                runs[:, 0] = starts
                runs[:, 1] = lengths
            self._cache[key] = runs
        result: IntArray = self._cache[key]
        return result

    @property
    def src_runs(self) -> IntArray:
        """``consecutive_runs(src)``: ``(position, length)`` rows."""
        return self._side_runs("src_runs", self.src, 0)

    @property
    def dst_runs(self) -> IntArray:
        """``consecutive_runs(dst)``: ``(position, length)`` rows."""
        return self._side_runs("dst_runs", self.dst, 1)

    def __repr__(self) -> str:
        return f"CopyPlan(src={self.src.tolist()}, dst={self.dst.tolist()})"


def _check_ids(name: str, ids: IntArray, num_blocks: int | None, factor: int) -> IntArray:
    """``ids`` as int64, each in ``[0, num_blocks)`` and with its last row
    (``id * factor + factor - 1``) inside int64 (``_rows.c`` bounds them the
    same way)."""
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TransferError(f"{name} block ids must be a 1-D integer array, got {ids!r}")
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    if ids.size:
        int64_max = int(np.iinfo(np.int64).max)
        fits = int64_max if factor == 1 else (int64_max - (factor - 1)) // factor + 1
        limit = fits if num_blocks is None else min(num_blocks, fits)
        # One reduction: as unsigned words, negative ids are above any bound.
        if int(ids.view(np.uint64).max()) >= limit:
            bad = ids[(ids < 0) | (ids >= limit)]
            why = "" if limit == num_blocks else f" (past it a block's {factor} rows pass int64)"
            raise TransferError(
                f"{name} block ids {bad[:8].tolist()} are out of range [0, {limit}){why}"
            )
    return ids


def _check_skips(name: str, n_blocks: int, factor: int, first: int, last: int) -> None:
    if not (0 <= first < factor and 0 <= last < factor):
        raise TransferError(
            f"{name} skips (first={first}, last={last}) must each lie in [0, {factor})"
        )
    if n_blocks == 0 and first + last:
        raise TransferError(f"{name} has no blocks but skips {first}+{last} sub-blocks")
    if n_blocks == 1 and first + last >= factor:
        raise TransferError(
            f"{name} is one block of {factor} sub-blocks; skipping {first}+{last} leaves none"
        )


def plan_copy(
    src_block_ids: IntArray,
    src_factor: int,
    dst_block_ids: IntArray,
    dst_factor: int,
    *,
    src_skip: tuple[int, int] | None = None,
    dst_skip: tuple[int, int] | None = None,
    src_num_blocks: int | None = None,
    dst_num_blocks: int | None = None,
) -> CopyPlan:
    """Pair the source and destination sub-block rows of one job.

    ``*_skip`` is ``(first, last)`` sub-blocks left out of that side; ``None``
    means "implicit": if the two sides' sub-block counts differ by less than
    the larger side's factor, that side skips the difference at the start of
    its first block (vLLM's convention, applied to both sides). ``*_num_blocks``
    bound the block ids when given.

    Raises :class:`~kvoffload.errors.TransferError` if the ids are malformed or
    out of range, a skip does not fit, the counts cannot be matched, or a
    destination row would be written twice. Postcondition: ``src`` and ``dst``
    have equal length, ``dst`` has no repeats, every row lies inside the
    named blocks.
    """
    if src_factor < 1 or dst_factor < 1:
        raise TransferError(f"block-size factors must be >= 1, got {src_factor}, {dst_factor}")
    src_ids, dst_ids = np.asarray(src_block_ids), np.asarray(dst_block_ids)
    plan = _plan_in_c(
        src_ids, src_factor, dst_ids, dst_factor, src_skip, dst_skip,
        src_num_blocks, dst_num_blocks,
    )  # fmt: skip
    if plan is not None:
        return plan
    src_ids = _check_ids("source", src_ids, src_num_blocks, src_factor)
    dst_ids = _check_ids("destination", dst_ids, dst_num_blocks, dst_factor)
    s_first, s_last, d_first, d_last = _resolve_skips(
        src_ids.size, src_factor, src_skip, dst_ids.size, dst_factor, dst_skip
    )
    # Writing one destination row twice would leave it holding whichever copy
    # happened to land last; it is always a caller bug, so refuse it.
    if dst_ids.size > 1:
        ordered = np.sort(dst_ids)
        if np.count_nonzero(ordered[1:] == ordered[:-1]):
            raise TransferError("destination block ids contain repeats")

    src = expand_block_ids(src_ids, src_factor, s_first, s_last)
    dst = expand_block_ids(dst_ids, dst_factor, d_first, d_last)
    return CopyPlan(src, dst)


def _resolve_skips(
    n_src_blocks: int,
    src_factor: int,
    src_skip: tuple[int, int] | None,
    n_dst_blocks: int,
    dst_factor: int,
    dst_skip: tuple[int, int] | None,
) -> tuple[int, int, int, int]:
    """``(src_first, src_last, dst_first, dst_last)`` for :func:`plan_copy`,
    implicit skips filled in; :class:`~kvoffload.errors.TransferError` if
    they do not fit or the counts cannot be matched."""
    s_first, s_last = src_skip if src_skip is not None else (0, 0)
    d_first, d_last = dst_skip if dst_skip is not None else (0, 0)
    # Explicit skips first: their errors say more than a count mismatch would.
    _check_skips("source", n_src_blocks, src_factor, s_first, s_last)
    _check_skips("destination", n_dst_blocks, dst_factor, d_first, d_last)
    n_src = n_src_blocks * src_factor - s_first - s_last
    n_dst = n_dst_blocks * dst_factor - d_first - d_last
    surplus = n_src - n_dst
    if surplus > 0 and src_skip is None and surplus < src_factor:
        s_first = surplus
    elif surplus < 0 and dst_skip is None and -surplus < dst_factor:
        d_first = -surplus
    elif surplus != 0:
        raise TransferError(
            f"cannot pair {n_src_blocks} source blocks x{src_factor} "
            f"(skip {s_first}+{s_last}) with {n_dst_blocks} destination blocks "
            f"x{dst_factor} (skip {d_first}+{d_last}): {n_src} != {n_dst} sub-blocks"
        )
    # The implicit skip is < factor by construction and leaves at least one
    # row of the first block; the assert guards that reasoning.
    assert 0 <= s_first < src_factor and 0 <= d_first < dst_factor
    return s_first, s_last, d_first, d_last


def _plan_in_c(
    src_ids: npt.NDArray[Any],
    src_factor: int,
    dst_ids: npt.NDArray[Any],
    dst_factor: int,
    src_skip: tuple[int, int] | None,
    dst_skip: tuple[int, int] | None,
    src_num_blocks: int | None,
    dst_num_blocks: int | None,
) -> CopyPlan | None:
    """:func:`plan_copy`'s plan in one C call (``_rows.plan_rows``), or
    ``None`` where the extension is absent, or for anything but int64
    vectors, in-range unique ids and fitting skips: the numpy path then
    finds the same plan or says what is wrong. Planning a 64-block job
    right after its 2 MiB copy (caches cold) takes 10-11 us this way against
    the numpy path's 22-24 (``bench/transfer.py --plan``)."""
    if _rows is None or not (
        src_ids.dtype == np.int64
        and dst_ids.dtype == np.int64
        and src_ids.ndim == 1
        and dst_ids.ndim == 1
    ):
        return None
    # Anything odd (skips that do not fit or are not pairs, a bound that is
    # negative, not an int or not an int64, an unaligned id buffer, rows too
    # many to allocate) is left to the numpy path, which says what is wrong.
    try:
        if any(b is not None and b < 0 for b in (src_num_blocks, dst_num_blocks)):
            return None
        s_first, s_last, d_first, d_last = _resolve_skips(
            src_ids.size, src_factor, src_skip, dst_ids.size, dst_factor, dst_skip
        )
        n = src_ids.size * src_factor - s_first - s_last
        src, dst = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        ok = _rows.plan_rows(
            np.ascontiguousarray(src_ids), src_factor, s_first, s_last,
            -1 if src_num_blocks is None else src_num_blocks,
            np.ascontiguousarray(dst_ids), dst_factor, d_first, d_last,
            -1 if dst_num_blocks is None else dst_num_blocks,
            src, dst,
        )  # fmt: skip
    except Exception:
        return None
    return CopyPlan(src, dst) if ok else None


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A validated job: its direction and the row pairing (GPU rows on one
    side, CPU-mirror rows on the other)."""

    direction: Direction
    copy: CopyPlan


def _cpu_skip(spec: LoadStoreSpec) -> tuple[int, int] | None:
    if not isinstance(spec, PartialCPULoadStoreSpec):
        return None
    first, last = getattr(spec, "skip_first", None), getattr(spec, "skip_last", None)
    if not (is_int(first) and is_int(last)):
        raise TransferError(
            f"{_class_name(spec)} skips must be ints, got skip_first={first!r}, skip_last={last!r}"
        )
    return (first, last)


def _class_name(spec: object) -> str:
    cls = type(spec)
    return f"{cls.__module__}.{cls.__qualname__}"


def _medium(spec: object) -> str | None:
    medium = getattr(spec, "medium", None)
    if not callable(medium):
        return None
    try:
        value = medium()
    except Exception:
        return None
    return value if isinstance(value, str) else None


def plan_transfer(
    spec: tuple[LoadStoreSpec, LoadStoreSpec],
    factor: int,
    *,
    num_gpu_blocks: int | None = None,
    num_cpu_blocks: int | None = None,
) -> TransferPlan:
    """Validate a ``(src, dst)`` spec pair and plan its rows.

    Specs are read by their ``medium()`` and ``block_ids``, not by class, so
    vLLM's own ``GPULoadStoreSpec`` / ``CPULoadStoreSpec`` (which its
    connector builds) work like kvoffload's. ``"GPU" -> "CPU"`` is a store,
    the reverse a load; any other pair raises
    :class:`~kvoffload.errors.TransferError` naming both classes with their
    modules, as does every condition :func:`plan_copy` refuses. CPU rows
    index the mirror whose block dimension is ``num_cpu_blocks * factor``.
    """
    src, dst = spec
    media = (_medium(src), _medium(dst))
    src_ids: Any = getattr(src, "block_ids", None)
    dst_ids: Any = getattr(dst, "block_ids", None)
    if media not in (("GPU", "CPU"), ("CPU", "GPU")) or src_ids is None or dst_ids is None:
        raise TransferError(
            f"unsupported spec pair {_class_name(src)} (medium {media[0]!r}) -> "
            f"{_class_name(dst)} (medium {media[1]!r}); expected specs with block_ids "
            "whose medium() is 'GPU' -> 'CPU' (store) or 'CPU' -> 'GPU' (load)"
        )
    if media == ("GPU", "CPU"):
        plan = plan_copy(
            src_ids,
            1,
            dst_ids,
            factor,
            src_skip=(0, 0),
            dst_skip=_cpu_skip(dst),
            src_num_blocks=num_gpu_blocks,
            dst_num_blocks=num_cpu_blocks,
        )
        return TransferPlan("store", plan)
    plan = plan_copy(
        src_ids,
        factor,
        dst_ids,
        1,
        src_skip=_cpu_skip(src),
        dst_skip=(0, 0),
        src_num_blocks=num_cpu_blocks,
        dst_num_blocks=num_gpu_blocks,
    )
    return TransferPlan("load", plan)


def admit_job(
    job_id: int,
    spec: tuple[LoadStoreSpec, LoadStoreSpec],
    factor: int,
    in_flight: Container[int],
    *,
    num_gpu_blocks: int | None = None,
    num_cpu_blocks: int | None = None,
) -> TransferPlan | None:
    """The plan of a job a handler may accept, or ``None`` (logged at
    WARNING with the reason) when its id is still in flight or
    :func:`plan_transfer` refuses it, or reading its specs raises anything
    at all (they are the caller's objects). Shared by every handler so that
    they refuse exactly the same jobs."""
    if job_id in in_flight:
        logger.warning("transfer %d refused: job id still in flight", job_id)
        return None
    try:
        return plan_transfer(
            spec, factor, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks
        )
    except Exception as exc:
        logger.warning("transfer %d refused: %s", job_id, exc)
        return None
