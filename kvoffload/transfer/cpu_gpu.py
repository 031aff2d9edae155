"""GPU <-> CPU block copies (vLLM 0.11.2 ``kv_offload.worker.cpu_gpu``).

The handler owns a CPU mirror of every layer's KV tensor whose block dimension
is ``num_cpu_blocks * factor`` rows (``factor = cpu_block_size /
gpu_block_size``). A store (a ``"GPU"`` spec -> a ``"CPU"`` spec) copies GPU
blocks into mirror rows, a load the reverse; which rows pair up is decided by
:func:`kvoffload.transfer.block_map.plan_transfer`, shared with the in-memory
fake.

On CUDA each direction has its own copy stream and each job one (pooled)
event; stores wait on the stream that produced the KV. Copies are batched: one
host<->device copy per run of consecutive mirror rows, with device-side
gathers/scatters (``index_select`` / ``index_copy_``) when the GPU side is
scattered. With CPU tensors as the "GPU" side the same class copies
synchronously at submit (see :mod:`kvoffload.transfer.host_copy`) and reports
the job on the next :meth:`get_finished`.

This module imports torch; :mod:`kvoffload.transfer` loads it lazily.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._checks import check_int, is_int
from kvoffload.errors import ConfigError
from kvoffload.transfer.block_map import TransferPlan, admit_job, consecutive_runs
from kvoffload.transfer.host_copy import HostCopier, RowPair
from kvoffload.transfer.layout import AttentionBackendLike, Layout, block_dim, resolve_layouts
from kvoffload.transfer.row_kernel import MAX_RUN_BYTES, copy_rows
from kvoffload.transfer.row_kernel import available as row_kernel_available
from kvoffload.transfer.worker import OffloadingHandler, TransferResult, TransferSpec

logger = logging.getLogger(__name__)

__all__ = ["CpuGpuOffloadingHandler", "default_max_cpu_bytes", "device_copy", "pinned_footprint"]

#: Share of physical memory the CPU mirror may take when no limit is given.
DEFAULT_RAM_FRACTION = 0.8
#: Bound on the device staging buffer of one gather/scatter (per layer view).
DEVICE_STAGING_BYTES = 64 << 20


def default_max_cpu_bytes() -> int | None:
    """:data:`DEFAULT_RAM_FRACTION` of physical memory, ``None`` if unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return int(total * DEFAULT_RAM_FRACTION) if total > 0 else None


def pinned_footprint(layer_bytes: list[int]) -> int:
    """Bytes of page-locked memory torch's caching host allocator takes for
    mirror layers of ``layer_bytes``: it rounds each allocation up to the next
    power of two (``torch.cuda.host_memory_stats``'s documentation says so;
    ATen's ``CachingHostAllocator`` rounds with ``PowerOf2Ceil``), so a
    2.1 GiB layer pins 4 GiB."""
    return sum(1 << (b - 1).bit_length() if b > 0 else 0 for b in layer_bytes)


def _block_factor(gpu_block_size: int, cpu_block_size: int) -> int:
    check_int("gpu_block_size", gpu_block_size, 1)
    check_int("cpu_block_size", cpu_block_size, 1)
    if cpu_block_size % gpu_block_size:
        raise ConfigError(
            f"cpu_block_size ({cpu_block_size}) must be a positive multiple of "
            f"gpu_block_size ({gpu_block_size})"
        )
    return cpu_block_size // gpu_block_size


def _check_caches(gpu_caches: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(gpu_caches, Mapping):
        raise ConfigError(
            f"gpu_caches must map layer names to torch.Tensor, got a {type(gpu_caches).__name__}"
        )
    for name, t in gpu_caches.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"gpu_caches[{name!r}] must be a torch.Tensor, got a {type(t).__name__}"
            )
        if t.layout != torch.strided or t.is_quantized:
            raise ConfigError(
                f"gpu_caches[{name!r}] must be a dense, unquantized tensor (its blocks are "
                f"copied as bytes), got layout {t.layout} and dtype {t.dtype}"
            )


def _resolve(
    gpu_caches: Mapping[str, torch.Tensor],
    layouts: Layout | Mapping[str, Layout] | None,
    num_gpu_blocks: int | None,
    attn_backends: Mapping[str, AttentionBackendLike] | None,
) -> tuple[dict[str, Layout], int]:
    """:func:`resolve_layouts` of the caches' shapes; a layer whose blocks
    hold no element (a zero-size dimension) is a ConfigError too."""
    resolved = resolve_layouts(
        {name: tuple(t.shape) for name, t in gpu_caches.items()},
        layouts,
        num_gpu_blocks,
        attn_backends,
    )
    for name, t in gpu_caches.items():
        if t.numel() == 0:
            raise ConfigError(
                f"layer {name!r}: a KV tensor of shape {tuple(t.shape)} has empty GPU "
                "blocks; every dimension must be >= 1"
            )
    return resolved


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _row_views(gpu: torch.Tensor, cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors (blocks on dim 0) as 2-D ``(blocks, words)`` integer views.

    Copying integers keeps every bit (NaN payloads of fp16/bf16 included) and
    wide words make the gather kernels cheaper. If either tensor cannot be
    flattened by a view (non-contiguous), both keep their shapes, reread as
    integers of the same size where there is one (torch has no CPU
    ``index_copy_`` for float8, for one), so the pair always has matching row
    shapes and dtypes.
    """
    if not (gpu.is_contiguous() and cpu.is_contiguous()) or gpu.dim() == 0:
        word = _SAME_SIZE_INT.get(gpu.element_size())
        if word is None or gpu.dtype.is_complex or gpu.dtype == word:
            return gpu, cpu
        try:
            return gpu.view(word), cpu.view(word)
        except RuntimeError:  # e.g. sub-byte dtypes: copied as they are, or refused
            return gpu, cpu
    nbytes = gpu[0].numel() * gpu.element_size()
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=word).element_size()
        if nbytes % size == 0 and gpu.data_ptr() % size == 0 and cpu.data_ptr() % size == 0:
            g, c = (t.reshape(t.shape[0], -1).view(torch.uint8).view(word) for t in (gpu, cpu))
            return g, c
    return gpu, cpu  # pragma: no cover - uint8 always divides


@dataclass(slots=True)
class _Job:
    event: torch.cuda.Event | None
    ok: bool
    direction: str = ""


class CpuGpuOffloadingHandler(OffloadingHandler):
    """Copies KV blocks between per-layer device tensors and a CPU mirror.

    Accepted jobs: stores from a ``"GPU"`` spec to a ``"CPU"`` spec and the
    reverse loads, specs read by ``medium()`` and ``block_ids`` (vLLM's own
    spec classes work like kvoffload's), with ``N`` GPU blocks and ``M`` CPU
    blocks where ``0 <= M*factor - N < factor``: the missing sub-blocks are
    skipped at the start of the first CPU block on either side (vLLM's rule
    for stores; for loads it fixes vLLM defect 7). A
    :class:`~kvoffload.transfer.block_map.PartialCPULoadStoreSpec` says
    exactly which sub-blocks of its first and last block take part, so a job
    may also end inside a CPU block. Malformed jobs (other spec types, counts
    that do not pair, ids out of range, repeated destination blocks, a job id
    still in flight) make :meth:`transfer_async` return ``False`` and log why;
    a copy that fails once started is reported as ``(job_id, False)``.

    Not thread-safe: like vLLM's worker, drive it from one thread. Ordering
    between jobs on the same CPU blocks is the manager's job (a block is
    loaded only after its store was reported, reused only after its loads
    were).
    """

    def __init__(
        self,
        gpu_block_size: int,
        cpu_block_size: int,
        num_cpu_blocks: int,
        gpu_caches: Mapping[str, torch.Tensor],
        attn_backends: Mapping[str, AttentionBackendLike] | None = None,
        *,
        layouts: Layout | Mapping[str, Layout] | None = None,
        num_gpu_blocks: int | None = None,
        max_cpu_bytes: int | Literal["auto"] | None = "auto",
        compute_stream: torch.cuda.Stream | None = None,
        pin_memory: bool | None = None,
        row_kernel: bool | None = None,
    ) -> None:
        """Resolve layouts, size and allocate the CPU mirror.

        ``layouts`` / ``attn_backends`` / ``num_gpu_blocks`` settle the layout
        of ``(2, n, ...)`` shapes (see
        :func:`~kvoffload.transfer.layout.resolve_layouts`). ``max_cpu_bytes``
        caps the mirror: ``"auto"`` is :func:`default_max_cpu_bytes`, ``None``
        no cap. ``compute_stream`` is the stream stores wait on (default: the
        current stream at each submit). ``pin_memory`` defaults to "when the
        caches are on CUDA". ``row_kernel`` says how a CUDA job with scattered
        mirror rows is copied (:mod:`kvoffload.transfer.row_kernel`): ``None``
        by the kernel where its runs are short and Triton is there, ``False``
        by the copy engines only, ``True`` by the kernel always (Triton
        required). Raises :class:`~kvoffload.errors.ConfigError` on bad sizes
        (ints >= 1), shapes, mixed devices, ``pin_memory=True`` without CUDA,
        ``row_kernel=True`` without CUDA, a pinned mirror or Triton, or a
        mirror above the cap, before allocating anything, and if allocating
        the mirror fails.
        """
        self.block_size_factor = _block_factor(gpu_block_size, cpu_block_size)
        check_int("num_cpu_blocks", num_cpu_blocks, 1)
        if not (max_cpu_bytes in (None, "auto") or (is_int(max_cpu_bytes) and max_cpu_bytes >= 0)):
            raise ConfigError(
                f"max_cpu_bytes must be 'auto', None or an int >= 0, got {max_cpu_bytes!r}"
            )
        if not (pin_memory is None or isinstance(pin_memory, bool)):
            raise ConfigError(f"pin_memory must be None, True or False, got {pin_memory!r}")
        if not (row_kernel is None or isinstance(row_kernel, bool)):
            raise ConfigError(f"row_kernel must be None, True or False, got {row_kernel!r}")
        _check_caches(gpu_caches)
        devices = {t.device for t in gpu_caches.values()}
        if len(devices) > 1:
            raise ConfigError(
                f"all KV tensors must be on one device, got {sorted(map(str, devices))}"
            )
        self.device: torch.device = next(iter(devices)) if devices else torch.device("cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"KV tensors on {self.device} are not supported (cuda or cpu only)")
        self.is_cuda = self.device.type == "cuda"
        pin = self.is_cuda if pin_memory is None else pin_memory
        if pin and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory=True needs CUDA (torch.cuda.is_available() is False); "
                "pass pin_memory=False or None"
            )
        # the kernel reads and writes the mirror over PCIe: pinned memory only
        usable = (
            row_kernel is not False and self.is_cuda and pin and row_kernel_available(self.device)
        )
        if row_kernel and not usable:
            raise ConfigError(
                "row_kernel=True needs KV tensors on CUDA, a pinned mirror and a working "
                f"Triton (on {self.device}, pinned: {pin}; see the log for Triton); "
                "pass row_kernel=None or False"
            )
        self._row_kernel: bool | None = row_kernel if usable else False

        self.layouts, self.num_gpu_blocks = _resolve(
            gpu_caches, layouts, num_gpu_blocks, attn_backends
        )
        self.num_cpu_blocks = num_cpu_blocks
        self.gpu_block_size = gpu_block_size
        self.cpu_block_size = cpu_block_size
        #: Bytes of one GPU block summed over all layers (K and V included).
        self.gpu_block_bytes = sum(
            t.numel() // self.num_gpu_blocks * t.element_size() for t in gpu_caches.values()
        )
        rows = num_cpu_blocks * self.block_size_factor
        layer_bytes = [
            t.numel() // self.num_gpu_blocks * t.element_size() * rows for t in gpu_caches.values()
        ]
        #: Bytes the CPU mirror takes.
        self.cpu_mirror_bytes = sum(layer_bytes)
        #: Bytes of page-locked memory the mirror holds (0 when not pinned):
        #: torch's pinned allocator rounds each layer's block up to a power of two.
        self.cpu_pinned_bytes = pinned_footprint(layer_bytes) if pin else 0
        held = max(self.cpu_mirror_bytes, self.cpu_pinned_bytes)
        limit = default_max_cpu_bytes() if max_cpu_bytes == "auto" else max_cpu_bytes
        logger.info(
            "CPU mirror: %d layers, %d CPU blocks x %d sub-blocks, %.3f GiB, %.3f GiB pinned "
            "(limit %s)",
            len(gpu_caches),
            num_cpu_blocks,
            self.block_size_factor,
            self.cpu_mirror_bytes / 2**30,
            self.cpu_pinned_bytes / 2**30,
            "none" if limit is None else f"{limit / 2**30:.3f} GiB",
        )
        if limit is not None and held > limit:
            default = (
                f" (by default {DEFAULT_RAM_FRACTION:.0%} of this machine's memory)"
                if max_cpu_bytes == "auto"
                else ""
            )
            rounded = (
                f", pinned as {held} bytes (torch's pinned allocator rounds each layer's "
                "block up to a power of two; a layer just under one wastes least)"
                if held > self.cpu_mirror_bytes
                else ""
            )
            raise ConfigError(
                f"the CPU mirror needs {self.cpu_mirror_bytes} bytes "
                f"({num_cpu_blocks} CPU blocks x {self.block_size_factor} x "
                f"{self.gpu_block_bytes} bytes per GPU block){rounded}, above "
                f"max_cpu_bytes={limit}{default}; lower the CPU blocks (kvoffload serve: "
                "--num-cpu-blocks / KVOFFLOAD_NUM_CPU_BLOCKS; vLLM: num_cpu_blocks), or pass "
                "the handler a larger max_cpu_bytes"
            )

        self.gpu_tensors: list[torch.Tensor] = []
        self.cpu_tensors: list[torch.Tensor] = []
        # Block-major (device view, mirror view) pairs: one per blocks_first
        # layer, two (K, V) per kv_first layer, so every copy below indexes
        # dim 0 and every mirror slice is contiguous.
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, gpu in gpu_caches.items():
            dim = block_dim(self.layouts[name])
            shape = list(gpu.shape)
            shape[dim] = rows
            try:
                cpu = torch.zeros(shape, dtype=gpu.dtype, device="cpu", pin_memory=pin)
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                raise ConfigError(
                    f"cannot allocate the CPU mirror ({self.cpu_mirror_bytes} bytes"
                    f"{' pinned' if pin else ''} for num_cpu_blocks={num_cpu_blocks}): {e}; "
                    "lower the CPU blocks (kvoffload serve: --num-cpu-blocks / "
                    "KVOFFLOAD_NUM_CPU_BLOCKS; vLLM: num_cpu_blocks)"
                ) from e
            self.gpu_tensors.append(gpu)
            self.cpu_tensors.append(cpu)
            if dim == 0:
                self._views.append(_row_views(gpu, cpu))
            else:
                self._views.extend(_row_views(gpu[i], cpu[i]) for i in range(2))

        self._jobs: dict[int, _Job] = {}
        self._host = HostCopier()
        if not self.is_cuda:
            self._host_pairs = {
                "store": [RowPair.of(g, c) for g, c in self._views],
                "load": [RowPair.of(c, g) for g, c in self._views],
            }
        self._event_pool: list[torch.cuda.Event] = []
        self._compute_stream = compute_stream
        if self.is_cuda:
            # torch.cuda's Stream/Event constructors and query() carry no
            # annotations; the ignores below are for mypy --strict only.
            self._streams = {
                "store": torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
                "load": torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
            }

    @staticmethod
    def mirror_bytes(
        gpu_caches: Mapping[str, torch.Tensor],
        gpu_block_size: int,
        cpu_block_size: int,
        num_cpu_blocks: int,
        *,
        layouts: Layout | Mapping[str, Layout] | None = None,
        num_gpu_blocks: int | None = None,
        attn_backends: Mapping[str, AttentionBackendLike] | None = None,
    ) -> int:
        """Bytes the mirror of ``gpu_caches`` would take; allocates nothing.
        Raises :class:`~kvoffload.errors.ConfigError` like the constructor."""
        factor = _block_factor(gpu_block_size, cpu_block_size)
        check_int("num_cpu_blocks", num_cpu_blocks, 1)
        _check_caches(gpu_caches)
        _, n_gpu = _resolve(gpu_caches, layouts, num_gpu_blocks, attn_backends)
        per_block = sum(t.numel() // n_gpu * t.element_size() for t in gpu_caches.values())
        return per_block * num_cpu_blocks * factor

    # -- protocol -------------------------------------------------------

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start a job; ``False`` (logged, nothing copied) if it is malformed
        or ``job_id`` is still in flight. Postcondition on ``True``: the job
        appears exactly once in a later :meth:`get_finished`."""
        plan = admit_job(
            job_id,
            spec,
            self.block_size_factor,
            self._jobs,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
        )
        if plan is None:
            return False
        if self.is_cuda:
            self._jobs[job_id] = self._submit_cuda(job_id, plan)
        else:
            self._jobs[job_id] = _Job(None, self._copy_now(job_id, plan))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs whose copies completed since the last call, in submit order,
        each reported once; after it is reported a job id may be reused."""
        done: list[TransferResult] = []
        # A stream finishes its work in order: after one pending job, later
        # jobs of that direction are pending too and need no query.
        pending: set[str] = set()
        for job_id, job in self._jobs.items():
            if job.event is None:
                done.append((job_id, job.ok))
            elif job.direction in pending:
                continue
            elif job.event.query():  # type: ignore[no-untyped-call]
                done.append((job_id, job.ok))
                self._event_pool.append(job.event)
            else:
                pending.add(job.direction)
        for job_id, _ in done:
            del self._jobs[job_id]
        return done

    @property
    def num_in_flight(self) -> int:
        """Jobs submitted and not yet reported."""
        return len(self._jobs)

    # -- CPU path -------------------------------------------------------

    def _copy_now(self, job_id: int, plan: TransferPlan) -> bool:
        try:
            for pair in self._host_pairs[plan.direction]:
                self._host.copy(pair, plan.copy)
        except Exception:
            logger.warning("transfer %d (%s) failed", job_id, plan.direction, exc_info=True)
            return False
        return True

    # -- CUDA path ------------------------------------------------------

    def _submit_cuda(self, job_id: int, plan: TransferPlan) -> _Job:
        stream = self._streams[plan.direction]
        event = (
            self._event_pool.pop() if self._event_pool else torch.cuda.Event()  # type: ignore[no-untyped-call]
        )
        if plan.direction == "store":
            # Defect 8: the KV may still be being written by the compute
            # stream; without this the copy can read stale blocks.
            producer = self._compute_stream or torch.cuda.current_stream(self.device)
            stream.wait_stream(producer)
        ok = True
        with torch.cuda.stream(stream):
            try:
                if plan.copy.num_rows:
                    device_copy(self._views, plan, self.device, kernel=self._row_kernel)
            except Exception:
                logger.warning("transfer %d (%s) failed", job_id, plan.direction, exc_info=True)
                ok = False
            # Recorded even on failure, so the job is reported only after the
            # copies already queued have stopped writing.
            event.record(stream)
        return _Job(event, ok, plan.direction)


def device_copy(
    views: list[tuple[torch.Tensor, torch.Tensor]],
    plan: TransferPlan,
    device: torch.device,
    staging_bytes: int = DEVICE_STAGING_BYTES,
    kernel: bool | None = None,
) -> None:
    """Queue the copies of one job on the current stream.

    ``views`` are ``(device tensor, mirror tensor)`` pairs with rows on dim 0.
    With ``kernel`` true, or ``None`` on CUDA where the job has several mirror
    runs averaging under :data:`~kvoffload.transfer.row_kernel.MAX_RUN_BYTES`, each
    2-D contiguous view is copied by one launch of the scattered-row kernel
    (the mirror must then be pinned). Otherwise the host (mirror) side is cut
    into runs of consecutive rows, one non-blocking host<->device copy each.
    Where the device rows are not consecutive they are gathered (store) or
    scattered (load) on the device through a staging buffer of at most
    ``staging_bytes`` (a larger job is done in chunks), so the number of PCIe
    copies follows the mirror's fragmentation, not the GPU's, and the extra
    device memory stays bounded. Works with CPU tensors too (nothing is
    pinned then), which is how its logic is tested without a GPU.
    """
    copy = plan.copy
    store = plan.direction == "store"
    host_runs = copy.dst_runs if store else copy.src_runs
    rows: torch.Tensor | None = None
    engine_views = []
    for gpu, cpu in views:
        row_bytes = (gpu.numel() // max(1, gpu.shape[0])) * gpu.element_size()
        use_kernel = (
            kernel is not False
            and gpu.dim() == 2
            and gpu.is_contiguous()
            and cpu.is_contiguous()
            and (
                kernel
                or (
                    device.type == "cuda"
                    and len(host_runs) > 1
                    and row_bytes * copy.num_rows < MAX_RUN_BYTES * len(host_runs)
                )
            )
        )
        if not use_kernel:
            engine_views.append((gpu, cpu))
            continue
        if rows is None:
            rows = _upload(np.stack((copy.src, copy.dst)), device)
        if store:
            copy_rows(gpu, cpu, rows)
        else:
            copy_rows(cpu, gpu, rows)
    if engine_views:
        _engine_copy(engine_views, plan, device, staging_bytes)


def _upload(idx: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    """``idx`` on ``device``, queued on the current stream."""
    t = torch.from_numpy(idx)
    if device.type == "cuda":
        # Pinned so the upload is asynchronous; the caching host allocator
        # keeps the pinned copy alive until the stream is done with it.
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _engine_copy(
    views: list[tuple[torch.Tensor, torch.Tensor]],
    plan: TransferPlan,
    device: torch.device,
    staging_bytes: int,
) -> None:
    """:func:`device_copy` by copy engines: one copy per mirror run."""
    copy = plan.copy
    store = plan.direction == "store"
    host_idx, dev_idx = (copy.dst, copy.src) if store else (copy.src, copy.dst)
    host_runs = copy.dst_runs if store else copy.src_runs
    if copy.num_runs == len(host_runs):
        # Every host run is device-consecutive too: straight slice copies.
        for gpu, cpu in views:
            for s, d, k in copy.runs.tolist():
                h, g = (d, s) if store else (s, d)
                if store:
                    cpu.narrow(0, h, k).copy_(gpu.narrow(0, g, k), non_blocking=True)
                else:
                    gpu.narrow(0, g, k).copy_(cpu.narrow(0, h, k), non_blocking=True)
        return
    dev_idx_t = _upload(dev_idx, device)
    n = copy.num_rows
    for gpu, cpu in views:
        row_bytes = max(1, (gpu.numel() // max(1, gpu.shape[0])) * gpu.element_size())
        step = max(1, staging_bytes // row_bytes)
        for p0 in range(0, n, step):
            k_chunk = min(step, n - p0)
            # Host runs of this chunk: the job's runs clipped to [p0, p0+k).
            chunk_runs = consecutive_runs(host_idx[p0 : p0 + k_chunk]).tolist()
            idx = dev_idx_t.narrow(0, p0, k_chunk)
            if store:
                staging = gpu.index_select(0, idx)
                for p, k in chunk_runs:
                    h = int(host_idx[p0 + p])
                    cpu.narrow(0, h, k).copy_(staging.narrow(0, p, k), non_blocking=True)
            else:
                staging = torch.empty((k_chunk, *gpu.shape[1:]), dtype=gpu.dtype, device=gpu.device)
                for p, k in chunk_runs:
                    h = int(host_idx[p0 + p])
                    staging.narrow(0, p, k).copy_(cpu.narrow(0, h, k), non_blocking=True)
                gpu.index_copy_(0, idx, staging)
            # Freed here while the stream may still use it: the caching
            # allocator hands the block only to later work on this same
            # stream, which runs after these copies.
            del staging
