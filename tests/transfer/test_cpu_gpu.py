"""CpuGpuOffloadingHandler: byte-exact copies, vLLM semantics, failures, config.

Every data test runs on CPU tensors and, marked ``gpu``, on CUDA when present.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from odd_specs import UnreadableIds, skipless

from kvoffload.errors import ConfigError
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import OffloadingWorker
from kvoffload.transfer.block_map import PartialCPULoadStoreSpec, plan_transfer
from kvoffload.transfer.cpu_gpu import (
    CpuGpuOffloadingHandler,
    default_max_cpu_bytes,
    device_copy,
    pinned_footprint,
)
from kvoffload.transfer.layout import Layout
from kvoffload.transfer.worker import TransferResult

CUDA = torch.cuda.is_available()
_ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
# "cuda" copies these small scattered rows with the row kernel (where Triton
# is there); "cuda-engines" with copy engines only (row_kernel=False).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=_ON_CUDA),
    pytest.param("cuda-engines", id="cuda-engines", marks=_ON_CUDA),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]
NUM_GPU = 12
NUM_CPU = 6
LAYERS: dict[str, Layout] = {"l0": "blocks_first", "l1": "kv_first", "l2": "blocks_first"}


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    """Uniformly random *bytes* (NaN and inf patterns included)."""
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def rows(t: torch.Tensor, layout: Layout, idx: list[int]) -> torch.Tensor:
    """Bytes of blocks ``idx`` of one layer tensor, K and V included."""
    picked = t[idx] if layout == "blocks_first" else t[:, idx]
    return picked.contiguous().cpu().view(torch.uint8)


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().cpu() for t in tensors]


@dataclass
class Rig:
    handler: CpuGpuOffloadingHandler
    device: str
    gen: torch.Generator

    @property
    def gpu(self) -> list[torch.Tensor]:
        return self.handler.gpu_tensors

    @property
    def cpu(self) -> list[torch.Tensor]:
        return self.handler.cpu_tensors

    def scramble_gpu(self) -> None:
        for t in self.gpu:
            t.copy_(random_tensor(tuple(t.shape), t.dtype, self.gen, self.device))

    def finished(self) -> list[TransferResult]:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return self.handler.get_finished()

    def assert_unchanged_except(
        self, tensors: list[torch.Tensor], before: list[torch.Tensor], changed: set[int]
    ) -> None:
        """Blocks of ``tensors`` outside ``changed`` equal ``before``."""
        for t, b, layout in zip(tensors, before, LAYERS.values(), strict=True):
            n = t.shape[0 if layout == "blocks_first" else 1]
            keep = [i for i in range(n) if i not in changed]
            assert torch.equal(rows(t, layout, keep), rows(b, layout, keep))


def make_rig(
    device: str, dtype: torch.dtype = torch.float16, factor: int = 3, seed: int = 0
) -> Rig:
    """A handler over random caches on ``device`` (one of DEVICES' names)."""
    device, row_kernel = ("cuda", False) if device == "cuda-engines" else (device, None)
    gen = torch.Generator().manual_seed(seed)
    caches = {
        name: random_tensor(
            (NUM_GPU, 4, 8) if layout == "blocks_first" else (2, NUM_GPU, 3, 8), dtype, gen, device
        )
        for name, layout in LAYERS.items()
    }
    handler = CpuGpuOffloadingHandler(
        16, 16 * factor, NUM_CPU, caches, layouts=dict(LAYERS), row_kernel=row_kernel
    )
    # Random mirror contents make "rows the job did not name are unchanged"
    # a real check rather than a comparison of zeros.
    for t in handler.cpu_tensors:
        t.copy_(random_tensor(tuple(t.shape), dtype, gen))
    return Rig(handler, device, gen)


def cpu_rows(ids: list[int], factor: int, skip_first: int = 0, skip_last: int = 0) -> list[int]:
    out = [b * factor + j for b in ids for j in range(factor)]
    return out[skip_first : len(out) - skip_last]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_gpu_round_trip_is_byte_exact(
    device: str, dtype: torch.dtype, factor: int, seed: int
) -> None:
    rig = make_rig(device, dtype, factor, seed)
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, min(NUM_CPU, NUM_GPU // factor) + 1))
    n = int(rng.integers(max(1, m * factor - factor + 1), m * factor + 1))  # partial first block
    gpu_ids = rng.choice(NUM_GPU, n, replace=False).tolist()
    cpu_ids = rng.choice(NUM_CPU, m, replace=False).tolist()
    stored = cpu_rows(cpu_ids, factor, m * factor - n)

    gpu_before, cpu_before = snapshot(rig.gpu), snapshot(rig.cpu)
    assert rig.handler.transfer_async(1, (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(cpu_ids)))
    assert rig.finished() == [(1, True)]
    for g, c, layout in zip(rig.gpu, rig.cpu, LAYERS.values(), strict=True):
        assert torch.equal(rows(c, layout, stored), rows(g, layout, gpu_ids))
    rig.assert_unchanged_except(rig.cpu, cpu_before, set(stored))
    rig.assert_unchanged_except(rig.gpu, gpu_before, set())  # the source is untouched

    rig.scramble_gpu()
    gpu_mid, cpu_mid = snapshot(rig.gpu), snapshot(rig.cpu)
    targets = rng.choice(NUM_GPU, n, replace=False).tolist()
    assert rig.handler.transfer_async(2, (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(targets)))
    assert rig.finished() == [(2, True)]
    for g, b, layout in zip(rig.gpu, gpu_before, LAYERS.values(), strict=True):
        assert torch.equal(rows(g, layout, targets), rows(b, layout, gpu_ids))
    rig.assert_unchanged_except(rig.gpu, gpu_mid, set(targets))
    rig.assert_unchanged_except(rig.cpu, cpu_mid, set())


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_gpu_load_from_middle_of_offloaded_block_defect7(device: str) -> None:
    # Two CPU blocks of 3 GPU blocks hold GPU blocks 0..5. The GPU already
    # has a prefix ending inside CPU block 4, so only 5 GPU blocks are loaded.
    # vLLM 0.11.2 asserts `src count == dst count` here; the job must succeed
    # and skip the first sub-block of the source instead.
    rig = make_rig(device, factor=3)
    assert rig.handler.transfer_async(1, (GPULoadStoreSpec(range(6)), CPULoadStoreSpec([4, 1])))
    assert rig.finished() == [(1, True)]
    original = snapshot(rig.gpu)
    rig.scramble_gpu()
    targets = [10, 11, 7, 8, 9]
    assert rig.handler.transfer_async(2, (CPULoadStoreSpec([4, 1]), GPULoadStoreSpec(targets)))
    assert rig.finished() == [(2, True)]
    for g, o, layout in zip(rig.gpu, original, LAYERS.values(), strict=True):
        assert torch.equal(rows(g, layout, targets), rows(o, layout, [1, 2, 3, 4, 5]))


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_gpu_partial_spec_ends_inside_a_block(device: str) -> None:
    rig = make_rig(device, factor=3)
    cpu_before = snapshot(rig.cpu)
    spec = PartialCPULoadStoreSpec([2, 5], skip_last=1)  # rows 6 7 8 15 16 (not 17)
    assert rig.handler.transfer_async(1, (GPULoadStoreSpec([0, 1, 2, 3, 4]), spec))
    assert rig.finished() == [(1, True)]
    for g, c, layout in zip(rig.gpu, rig.cpu, LAYERS.values(), strict=True):
        assert torch.equal(rows(c, layout, [6, 7, 8, 15, 16]), rows(g, layout, [0, 1, 2, 3, 4]))
    rig.assert_unchanged_except(rig.cpu, cpu_before, {6, 7, 8, 15, 16})

    original = snapshot(rig.gpu)
    middle = PartialCPULoadStoreSpec([2, 5], skip_first=1, skip_last=1)  # rows 7 8 15 16
    assert rig.handler.transfer_async(2, (middle, GPULoadStoreSpec([11, 10, 9, 8])))
    assert rig.finished() == [(2, True)]
    for g, o, layout in zip(rig.gpu, original, LAYERS.values(), strict=True):
        assert torch.equal(rows(g, layout, [11, 10, 9, 8]), rows(o, layout, [1, 2, 3, 4]))


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_gpu_contiguous_ids_round_trip(device: str) -> None:
    # Contiguous ids take the one-slice-per-run path rather than a gather.
    rig = make_rig(device, factor=2)
    assert rig.handler.transfer_async(
        1, (GPULoadStoreSpec(range(2, 8)), CPULoadStoreSpec([1, 2, 3]))
    )
    assert rig.finished() == [(1, True)]
    original = snapshot(rig.gpu)
    rig.scramble_gpu()
    assert rig.handler.transfer_async(2, (CPULoadStoreSpec([1, 2, 3]), GPULoadStoreSpec(range(6))))
    assert rig.finished() == [(2, True)]
    for g, o, layout in zip(rig.gpu, original, LAYERS.values(), strict=True):
        assert torch.equal(rows(g, layout, list(range(6))), rows(o, layout, list(range(2, 8))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float64])
def test_cpu_gpu_non_contiguous_cache_round_trip(device: str, dtype: torch.dtype) -> None:
    # A permuted view (vLLM permutes caches by the backend's stride order)
    # cannot be flattened into integer rows; the handler copies it in its own
    # shape, as integers of the same size.
    device, row_kernel = ("cuda", False) if device == "cuda-engines" else (device, None)
    gen = torch.Generator().manual_seed(5)
    base = random_tensor((4, 8, NUM_GPU), dtype, gen, device)
    cache = base.permute(2, 0, 1)
    assert not cache.is_contiguous()
    h = CpuGpuOffloadingHandler(16, 16, NUM_CPU, {"l": cache}, row_kernel=row_kernel)
    assert h.transfer_async(1, (GPULoadStoreSpec([9, 3, 5]), CPULoadStoreSpec([4, 0, 2])))
    if device == "cuda":
        torch.cuda.synchronize()
    assert h.get_finished() == [(1, True)]
    expected = cache[[9, 3, 5]].contiguous().cpu().view(torch.uint8)
    assert torch.equal(h.cpu_tensors[0][[4, 0, 2]].contiguous().view(torch.uint8), expected)
    assert h.transfer_async(2, (CPULoadStoreSpec([4, 0, 2]), GPULoadStoreSpec([0, 1, 2])))
    if device == "cuda":
        torch.cuda.synchronize()
    assert h.get_finished() == [(2, True)]
    assert torch.equal(cache[[0, 1, 2]].contiguous().cpu().view(torch.uint8), expected)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_device_copy_takes_the_handlers_views_of_a_permuted_float8_cache(
    direction: str,
) -> None:
    """The CUDA path's logic on CPU tensors: a scattered load into a permuted
    float8 cache needs ``index_copy_``, which torch has for integers only."""
    gen = torch.Generator().manual_seed(6)
    cache = random_tensor((4, 8, NUM_GPU), torch.float8_e4m3fn, gen).permute(2, 0, 1)
    h = CpuGpuOffloadingHandler(16, 16, NUM_CPU, {"l": cache})
    gpu, cpu = h._views[0]
    assert gpu.dtype == cpu.dtype == torch.uint8 and not gpu.is_contiguous()
    cpu.copy_(random_tensor(tuple(cpu.shape), torch.uint8, gen))
    gpu_ids, cpu_ids = [9, 3, 5], [0, 1, 2]
    spec = (
        (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(cpu_ids))
        if direction == "store"
        else (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids))
    )
    plan = plan_transfer(spec, 1, num_gpu_blocks=NUM_GPU, num_cpu_blocks=NUM_CPU)
    device_copy(h._views, plan, torch.device("cpu"), kernel=False)
    assert torch.equal(gpu[gpu_ids], cpu[cpu_ids])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param((GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([0])), id="too-many-gpu"),
        pytest.param((GPULoadStoreSpec([0]), CPULoadStoreSpec([0, 1])), id="too-many-cpu"),
        pytest.param((CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0])), id="load-counts"),
        pytest.param((GPULoadStoreSpec([0, 1, NUM_GPU]), CPULoadStoreSpec([0])), id="gpu-range"),
        pytest.param((GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([NUM_CPU])), id="cpu-range"),
        pytest.param((CPULoadStoreSpec([-1]), GPULoadStoreSpec([0, 1, 2])), id="negative"),
        pytest.param((CPULoadStoreSpec([0]), GPULoadStoreSpec([1, 1, 2])), id="dst-repeat"),
        pytest.param((GPULoadStoreSpec([0]), GPULoadStoreSpec([1])), id="gpu-gpu"),
        pytest.param((CPULoadStoreSpec([0]), CPULoadStoreSpec([1])), id="cpu-cpu"),
        pytest.param(
            (PartialCPULoadStoreSpec([0], skip_first=2, skip_last=1), GPULoadStoreSpec([])),
            id="partial-empty",
        ),
        pytest.param((GPULoadStoreSpec([0, 1, 2]), skipless()), id="partial-without-skips"),
        pytest.param((UnreadableIds([0]), GPULoadStoreSpec([0, 1, 2])), id="unreadable-ids"),
    ],
)
def test_cpu_gpu_malformed_job_is_refused_without_side_effects(
    device: str, spec: tuple[GPULoadStoreSpec, CPULoadStoreSpec], caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(device, factor=3)
    gpu_before, cpu_before = snapshot(rig.gpu), snapshot(rig.cpu)
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.cpu_gpu"):
        assert rig.handler.transfer_async(7, spec) is False
    assert "transfer 7 refused" in caplog.text
    assert rig.finished() == []
    rig.assert_unchanged_except(rig.gpu, gpu_before, set())
    rig.assert_unchanged_except(rig.cpu, cpu_before, set())
    # the refused id is free; a good job under it goes through
    assert rig.handler.transfer_async(7, (GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0])))
    assert rig.finished() == [(7, True)]


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_gpu_job_id_in_flight_is_refused(device: str) -> None:
    rig = make_rig(device, factor=1)
    assert rig.handler.transfer_async(3, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert rig.handler.num_in_flight == 1
    assert rig.handler.transfer_async(3, (GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))) is False
    assert rig.finished() == [(3, True)]
    assert rig.handler.get_finished() == []  # reported once
    assert rig.handler.transfer_async(3, (GPULoadStoreSpec([1]), CPULoadStoreSpec([1])))
    assert rig.finished() == [(3, True)]


def test_cpu_gpu_copy_error_reports_job_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig("cpu", factor=1)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(rig.handler._host, "copy", broken)
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.cpu_gpu"):
        assert rig.handler.transfer_async(4, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert "transfer 4 (store) failed" in caplog.text
    assert rig.handler.get_finished() == [(4, False)]


def test_cpu_gpu_jobs_report_in_submit_order_through_worker() -> None:
    rig = make_rig("cpu", factor=2)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, rig.handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, rig.handler)
    assert worker.transfer_async(1, (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0])))
    assert worker.transfer_async(2, (CPULoadStoreSpec([0]), GPULoadStoreSpec([5, 6])))
    assert not worker.transfer_async(3, (CPULoadStoreSpec([0]), GPULoadStoreSpec([5, 6, 7])))
    assert worker.get_finished() == [(1, True), (2, True)]
    assert worker.get_finished() == []


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cpu_gpu_cuda_jobs_report_once_in_submit_order_across_streams() -> None:
    # Stores and loads run on two streams; a job is reported once its own
    # stream reached it, never before an earlier job of the same direction,
    # always in submit order.
    cache = torch.zeros((8, 1 << 16), dtype=torch.float32, device="cuda")
    h = CpuGpuOffloadingHandler(16, 16, 8, {"l": cache})
    store = h._streams["store"]
    with torch.cuda.stream(store):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: holds every store behind it
    for job_id in (1, 2):
        assert h.transfer_async(job_id, (GPULoadStoreSpec([job_id]), CPULoadStoreSpec([job_id])))
    assert h.transfer_async(3, (CPULoadStoreSpec([5]), GPULoadStoreSpec([5])))
    h._streams["load"].synchronize()
    assert h.get_finished() == [(3, True)]
    assert h.num_in_flight == 2
    torch.cuda.synchronize()
    assert h.get_finished() == [(1, True), (2, True)]
    assert h.get_finished() == []


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_gpu_empty_job_succeeds(device: str) -> None:
    rig = make_rig(device)
    assert rig.handler.transfer_async(1, (GPULoadStoreSpec([]), CPULoadStoreSpec([])))
    assert rig.finished() == [(1, True)]


# -- configuration ---------------------------------------------------------


def caches(shape: tuple[int, ...] = (NUM_GPU, 4, 8), layers: int = 2) -> dict[str, torch.Tensor]:
    return {f"l{i}": torch.zeros(shape, dtype=torch.float16) for i in range(layers)}


def test_cpu_gpu_cpu_block_size_must_be_a_multiple() -> None:
    with pytest.raises(ConfigError, match=r"cpu_block_size \(40\).*gpu_block_size \(16\)"):
        CpuGpuOffloadingHandler(16, 40, 4, caches())
    with pytest.raises(ConfigError, match="num_cpu_blocks must be an int >= 1, got 0"):
        CpuGpuOffloadingHandler(16, 32, 0, caches())


_MIRROR_ARGS = {"gpu_caches", "gpu_block_size", "cpu_block_size", "num_cpu_blocks"}
_MIRROR_ARGS |= {"layouts", "num_gpu_blocks", "attn_backends"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_cpu_blocks": 4.5}, "num_cpu_blocks must be an int >= 1, got 4.5"),
        ({"num_cpu_blocks": "4"}, "num_cpu_blocks must be an int >= 1, got '4'"),
        ({"num_cpu_blocks": True}, "num_cpu_blocks must be an int >= 1, got True"),
        ({"gpu_block_size": 16.0}, "gpu_block_size must be an int >= 1, got 16.0"),
        (
            {"gpu_block_size": True, "cpu_block_size": True},
            "gpu_block_size must be an int >= 1, got True",
        ),
        ({"cpu_block_size": 32.0}, "cpu_block_size must be an int >= 1, got 32.0"),
        ({"num_gpu_blocks": 12.0}, "num_gpu_blocks must be None or an int >= 1, got 12.0"),
        ({"num_gpu_blocks": True}, "num_gpu_blocks must be None or an int >= 1, got True"),
        ({"layouts": ["blocks_first"]}, "layouts must be None, one of ('blocks_first',"),
        ({"attn_backends": ["flash"]}, "attn_backends must be None or a mapping"),
        (
            {"gpu_caches": {"l0": torch.zeros(NUM_GPU, 16, 0)}},
            "layer 'l0': a KV tensor of shape (12, 16, 0) has empty GPU blocks",
        ),
        ({"gpu_caches": {"l0": [[0.0]]}}, "gpu_caches['l0'] must be a torch.Tensor, got a list"),
        ({"gpu_caches": [torch.zeros(4)]}, "gpu_caches must map layer names to torch.Tensor"),
        (
            {"gpu_caches": {"l0": torch.zeros(NUM_GPU, 16).to_sparse()}},
            "gpu_caches['l0'] must be a dense, unquantized tensor (its blocks are copied as "
            "bytes), got layout torch.sparse_coo",
        ),
        (
            {"max_cpu_bytes": "none"},
            "max_cpu_bytes must be 'auto', None or an int >= 0, got 'none'",
        ),
        (
            {"max_cpu_bytes": 1e12},
            "max_cpu_bytes must be 'auto', None or an int >= 0, got 1000000000000.0",
        ),
        ({"pin_memory": "yes"}, "pin_memory must be None, True or False, got 'yes'"),
        ({"row_kernel": 1}, "row_kernel must be None, True or False, got 1"),
    ],
)
def test_cpu_gpu_bad_arguments_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    # once raw TypeErrors/RuntimeErrors from torch, or accepted (8.0 blocks, True sizes)
    args: dict[str, object] = {
        "gpu_block_size": 16,
        "cpu_block_size": 16,
        "num_cpu_blocks": 4,
        "gpu_caches": caches(),
    }
    args |= kwargs
    with pytest.raises(ConfigError, match=re.escape(message)):
        CpuGpuOffloadingHandler(**args)  # type: ignore[arg-type]
    if set(kwargs) <= _MIRROR_ARGS:
        with pytest.raises(ConfigError, match=re.escape(message)):
            CpuGpuOffloadingHandler.mirror_bytes(**args)  # type: ignore[arg-type]


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_cpu_gpu_pin_memory_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"pin_memory=True needs CUDA"):
        CpuGpuOffloadingHandler(16, 16, 4, caches(), pin_memory=True)


def test_cpu_gpu_row_kernel_needs_a_pinned_cuda_mirror() -> None:
    # The kernel reaches the mirror through its device mapping: CPU caches, or
    # an unpinned mirror, cannot take it, and saying so beats a crash at the
    # first job.
    with pytest.raises(ConfigError, match=r"row_kernel=True needs KV tensors on CUDA.*pinned: "):
        CpuGpuOffloadingHandler(16, 16, 4, caches(), row_kernel=True)
    if CUDA:
        on_gpu = {name: t.cuda() for name, t in caches().items()}
        with pytest.raises(ConfigError, match=r"pinned: False"):
            CpuGpuOffloadingHandler(16, 16, 4, on_gpu, pin_memory=False, row_kernel=True)


def test_row_kernel_probe_failure_keeps_the_copy_engines(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No Triton (or a device whose pinned memory the kernel cannot reach):
    # the probe says so once, in the log, and answers False.
    from kvoffload.transfer import row_kernel

    def no_triton() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(row_kernel, "_kernel", no_triton)
    row_kernel.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.row_kernel"):
            assert row_kernel.available(torch.device("cpu")) is False
    finally:
        row_kernel.available.cache_clear()
    assert "the scattered-row copy kernel is not usable on cpu (ImportError" in caplog.text
    assert "scattered jobs go to the copy engines" in caplog.text


def test_pinned_footprint_rounds_each_layer_up_to_a_power_of_two() -> None:
    assert pinned_footprint([(3 << 20) + 4096, 4 << 20, 1, 0]) == (8 << 20) + 1
    assert CpuGpuOffloadingHandler(16, 16, 4, caches()).cpu_pinned_bytes == 0  # not pinned


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cpu_gpu_mirror_limit_counts_the_pinned_rounding() -> None:
    # A layer of 3 MiB + 4 KiB pins 4 MiB: the limit is checked against that.
    kv = {"l": torch.zeros((16, (3 << 20) // 16 + 256), dtype=torch.uint8, device="cuda")}
    with pytest.raises(ConfigError, match=r"pinned as 4194304 bytes \(torch's pinned allocator"):
        CpuGpuOffloadingHandler(16, 16, 16, kv, max_cpu_bytes=(3 << 20) + 4096)
    h = CpuGpuOffloadingHandler(16, 16, 16, kv, max_cpu_bytes=4 << 20)
    assert (h.cpu_mirror_bytes, h.cpu_pinned_bytes) == ((3 << 20) + 4096, 4 << 20)
    assert CpuGpuOffloadingHandler(16, 16, 16, kv, pin_memory=False).cpu_pinned_bytes == 0


def test_cpu_gpu_mirror_allocation_failure_is_a_config_error() -> None:
    # 2**60 bytes: more than any allocator or address space hands out
    kv = {"a": torch.zeros(NUM_GPU, 1 << 10, dtype=torch.uint8)}
    need = CpuGpuOffloadingHandler.mirror_bytes(kv, 16, 16, 1 << 50)
    assert need == 1 << 60
    with pytest.raises(ConfigError) as raised:
        CpuGpuOffloadingHandler(16, 16, 1 << 50, kv, max_cpu_bytes=None)
    message = str(raised.value)
    assert message.startswith(f"cannot allocate the CPU mirror ({need} bytes for num_cpu_blocks=")
    assert "--num-cpu-blocks" in message and "vLLM: num_cpu_blocks" in message


def test_cpu_gpu_mirror_size_is_computed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    kv = {"a": torch.zeros(NUM_GPU, 4, 8, dtype=torch.float16)}
    kv["b"] = torch.zeros(2, NUM_GPU, 3, 8, dtype=torch.float32)
    expected = (4 * 8 * 2 + 2 * 3 * 8 * 4) * 5 * 2
    assert CpuGpuOffloadingHandler.mirror_bytes(kv, 16, 32, 5) == expected
    with caplog.at_level(logging.INFO, logger="kvoffload.transfer.cpu_gpu"):
        h = CpuGpuOffloadingHandler(16, 32, 5, kv)
    assert h.cpu_mirror_bytes == expected
    assert sum(t.numel() * t.element_size() for t in h.cpu_tensors) == expected
    assert h.layouts == {"a": "blocks_first", "b": "kv_first"}
    assert [tuple(t.shape) for t in h.cpu_tensors] == [(10, 4, 8), (2, 10, 3, 8)]
    assert "CPU mirror: 2 layers" in caplog.text


def test_cpu_gpu_mirror_above_limit_is_refused() -> None:
    need = CpuGpuOffloadingHandler.mirror_bytes(caches(), 16, 16, 100)
    with pytest.raises(ConfigError, match=rf"needs {need} bytes.*max_cpu_bytes={need - 1}"):
        CpuGpuOffloadingHandler(16, 16, 100, caches(), max_cpu_bytes=need - 1)
    CpuGpuOffloadingHandler(16, 16, 100, caches(), max_cpu_bytes=need)
    CpuGpuOffloadingHandler(16, 16, 100, caches(), max_cpu_bytes=None)


def test_cpu_gpu_default_limit_is_a_fraction_of_ram() -> None:
    limit = default_max_cpu_bytes()
    assert limit is None or limit > 0
    if limit is not None:
        # A mirror of 100 TB exceeds any machine's default.
        huge = {"a": torch.empty((1, 1 << 20), dtype=torch.uint8)}
        with pytest.raises(ConfigError, match="above max_cpu_bytes") as raised:
            CpuGpuOffloadingHandler(16, 16, 100_000_000, huge)
        # the names a user can act on (the message once named only a Python
        # argument that `kvoffload serve` has no flag for)
        message = str(raised.value)
        assert "80% of this machine's memory" in message and "--num-cpu-blocks" in message
        assert "vLLM: num_cpu_blocks" in message


def test_cpu_gpu_ambiguous_layout_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="ambiguous"):
        CpuGpuOffloadingHandler(16, 16, 4, caches((2, NUM_GPU, 8)))
    h = CpuGpuOffloadingHandler(16, 16, 4, caches((2, NUM_GPU, 8)), num_gpu_blocks=NUM_GPU)
    assert set(h.layouts.values()) == {"kv_first"}
    with pytest.raises(ConfigError, match="disagree"):
        CpuGpuOffloadingHandler(16, 16, 4, {"a": torch.zeros(3, 8), "b": torch.zeros(4, 8)})


class _FlashAttnLike:
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def test_cpu_gpu_accepts_vllm_positional_signature_with_attn_backends() -> None:
    kv = {"a": torch.zeros(2, NUM_GPU, 16, 2, 4)}
    h = CpuGpuOffloadingHandler(16, 32, 3, kv, {"a": _FlashAttnLike()})
    assert h.layouts == {"a": "kv_first"}
    assert h.num_gpu_blocks == NUM_GPU
    assert h.block_size_factor == 2


# -- CUDA only ---------------------------------------------------------------


@pytest.fixture
def cuda_rig() -> Iterator[Rig]:
    if not CUDA:
        pytest.skip("needs a CUDA device")
    yield make_rig("cuda", torch.float32, factor=1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cpu_gpu_cuda_mirror_is_pinned(cuda_rig: Rig) -> None:
    assert all(t.is_pinned() for t in cuda_rig.cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("explicit", [False, True])
def test_cpu_gpu_store_waits_for_compute_stream_defect8(explicit: bool) -> None:
    # The KV is written by a kernel queued behind a long sleep; a store that
    # does not wait for that stream would copy the old contents.
    cache = torch.zeros((8, 1 << 16), dtype=torch.float32, device="cuda")
    compute = torch.cuda.Stream() if explicit else torch.cuda.current_stream()
    h = CpuGpuOffloadingHandler(
        16, 16, 8, {"l": cache}, compute_stream=compute if explicit else None
    )
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles
        cache.fill_(7.0)
    # Submitted from the default stream: only compute_stream= (explicit) or
    # the current stream (which *is* compute when not explicit) orders it.
    assert h.transfer_async(1, (GPULoadStoreSpec(range(8)), CPULoadStoreSpec(range(8))))
    torch.cuda.synchronize()
    assert h.get_finished() == [(1, True)]
    assert bool((h.cpu_tensors[0] == 7.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("row_kernel", "block_words", "mirror_ids", "kernel_launches"),
    [
        (None, 64, [1, 7, 2], 3),
        (None, 1 << 18, [1, 7, 2], 0),
        (None, 64, [1, 2, 3], 0),
        (False, 64, [1, 7, 2], 0),
        (True, 1 << 18, [1, 2, 3], 3),
    ],
)
def test_cpu_gpu_row_kernel_takes_short_scattered_runs(
    monkeypatch: pytest.MonkeyPatch,
    row_kernel: bool | None,
    block_words: int,
    mirror_ids: list[int],
    kernel_launches: int,
) -> None:
    # By default the kernel takes jobs of several mirror runs averaging under
    # MAX_RUN_BYTES (here 512 B rows) and leaves 2 MiB rows and a single run
    # to the copy engines; False and True decide for every job. One launch
    # per view.
    from kvoffload.transfer import cpu_gpu

    launches: list[int] = []
    real = cpu_gpu.copy_rows

    def counted(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
        launches.append(rows.shape[1])
        real(src, dst, rows)

    monkeypatch.setattr(cpu_gpu, "copy_rows", counted)
    gen = torch.Generator().manual_seed(3)
    kv = {f"l{i}": random_tensor((8, block_words), torch.int64, gen, "cuda") for i in range(3)}
    h = CpuGpuOffloadingHandler(16, 16, 8, kv, row_kernel=row_kernel)
    assert h.transfer_async(1, (GPULoadStoreSpec([5, 0, 3]), CPULoadStoreSpec(mirror_ids)))
    torch.cuda.synchronize()
    assert h.get_finished() == [(1, True)]
    assert launches == [3] * kernel_launches
    for g, c in zip(h.gpu_tensors, h.cpu_tensors, strict=True):
        assert torch.equal(c[mirror_ids], g[[5, 0, 3]].cpu())


# -- the CUDA copy logic, exercised on CPU tensors -------------------------


@pytest.fixture(params=[None, True], ids=["engines", "kernel"])
def kernel(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[bool | None]:
    """device_copy's ``kernel``: the row kernel runs in Triton's interpreter
    on these CPU tensors (skipped without Triton)."""
    if request.param is None:
        yield None
        return
    pytest.importorskip("triton", reason="the row kernel needs Triton")
    from kvoffload.transfer import row_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    row_kernel._kernel.cache_clear()
    yield True
    row_kernel._kernel.cache_clear()


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("staging_rows", [1, 3, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_device_copy_matches_plan(
    direction: str, factor: int, staging_rows: int, seed: int, kernel: bool | None
) -> None:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    gpu = random_tensor((40, 3, 4), torch.float16, gen)
    cpu = random_tensor((10 * factor, 3, 4), torch.float16, gen)
    m = int(rng.integers(1, 6))
    n = int(rng.integers(max(1, m * factor - factor + 1), m * factor + 1))
    gpu_ids = (
        np.sort(rng.choice(40, n, replace=False)) if seed == 0 else rng.choice(40, n, replace=False)
    )
    cpu_ids = rng.choice(10, m, replace=False)
    spec = (
        (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(cpu_ids))
        if direction == "store"
        else (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids))
    )
    plan = plan_transfer(spec, factor)
    src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
    expected = dst.clone()
    expected[torch.from_numpy(plan.copy.dst)] = src[torch.from_numpy(plan.copy.src)]
    src_before = src.clone()
    row_bytes = 3 * 4 * 2
    if kernel:  # the kernel copies 2-D integer views (what the handler gives it)
        gpu_rows, cpu_rows = (t.view(t.shape[0], -1).view(torch.int16) for t in (gpu, cpu))
    else:
        gpu_rows, cpu_rows = gpu, cpu
    device_copy(
        [(gpu_rows, cpu_rows)],
        plan,
        torch.device("cpu"),
        staging_bytes=staging_rows * row_bytes,
        kernel=kernel,
    )
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(src.view(torch.uint8), src_before.view(torch.uint8))
