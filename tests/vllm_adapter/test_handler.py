"""ReportingHandler: kvoffload's copy handler as vLLM's worker drives it,
reporting every finished job to the process's transfer listeners."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvoffload.mediums import CPULoadStoreSpec
from kvoffload.runtime.observer import TransferRecord
from kvoffload.transfer import CpuGpuOffloadingHandler
from kvoffload.transfer.layout import Layout
from kvoffload.vllm import ReportingHandler, add_transfer_listener, live, live_handlers

GPU_BLOCKS = 8


class VLLMShapedGPUSpec:
    """Like vLLM 0.11.2's ``GPULoadStoreSpec`` (what its connector builds):
    no kvoffload base class, a plain ``block_ids`` array, ``medium()``."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)

    @staticmethod
    def medium() -> str:
        return "GPU"


def _caches(layout: Layout) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    shape = (2, GPU_BLOCKS, 2, 4, 8) if layout == "kv_first" else (GPU_BLOCKS, 2, 2, 4, 8)
    return {"l0": torch.randn(shape), "l1": torch.randn(shape)}


def _handler(layout: Layout = "kv_first") -> ReportingHandler:
    caches = _caches(layout)
    inner = CpuGpuOffloadingHandler(
        gpu_block_size=4, cpu_block_size=8, num_cpu_blocks=4, gpu_caches=caches, layouts=layout
    )
    return ReportingHandler(inner)


def _block(h: ReportingHandler, layout: Layout, i: int) -> list[torch.Tensor]:
    return [t[:, i] if layout == "kv_first" else t[i] for t in h.inner.gpu_tensors]


@pytest.fixture
def records() -> Iterator[list[TransferRecord]]:
    got: list[TransferRecord] = []
    remove = add_transfer_listener(got.append)
    yield got
    remove()


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
def test_reporting_handler_round_trip_reports_each_job(
    layout: Layout, records: list[TransferRecord]
) -> None:
    h = _handler(layout)
    stored = [b.clone() for i in (2, 3) for b in _block(h, layout, i)]
    assert h.transfer_async(1, (VLLMShapedGPUSpec([2, 3]), CPULoadStoreSpec([1])))  # type: ignore[arg-type]
    assert h.get_finished() == [(1, True)]
    assert h.transfer_async(2, (CPULoadStoreSpec([1]), VLLMShapedGPUSpec([6, 7])))  # type: ignore[arg-type]
    assert h.get_finished() == [(2, True)]
    loaded = [b for i in (6, 7) for b in _block(h, layout, i)]
    assert all(torch.equal(a, b) for a, b in zip(stored, loaded, strict=True))

    per_block = h.inner.gpu_block_bytes
    assert per_block == 2 * 2 * 2 * 4 * 8 * 4  # layers x K,V x heads x tokens x dim x fp32
    assert [(r.job_id, r.direction, r.blocks, r.nbytes, r.ok) for r in records] == [
        (1, "store", 2, 2 * per_block, True),
        (2, "load", 2, 2 * per_block, True),
    ]
    assert all(r.finished_ns >= r.submitted_ns for r in records)


class ListGPUSpec(VLLMShapedGPUSpec):
    """A duck-typed spec whose ``block_ids`` is a plain list (the docs accept
    any spec with ``medium()`` and ``block_ids``)."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids  # type: ignore[assignment]


def test_reporting_handler_takes_block_ids_in_a_list(records: list[TransferRecord]) -> None:
    # the copy was made, then tolist() raised: the job was lost, and the next
    # poll's KeyError lost every other finished job with it
    h = _handler()
    assert h.transfer_async(1, (ListGPUSpec([2, 3]), CPULoadStoreSpec([1])))  # type: ignore[arg-type]
    assert h.transfer_async(2, (CPULoadStoreSpec([1]), ListGPUSpec([6, 7])))  # type: ignore[arg-type]
    assert sorted(h.get_finished()) == [(1, True), (2, True)]
    assert sorted((r.job_id, r.direction, r.blocks) for r in records) == [
        (1, "store", 2),
        (2, "load", 2),
    ]


def test_reporting_handler_refused_job_is_not_reported(records: list[TransferRecord]) -> None:
    h = _handler()
    # 3 GPU blocks cannot fill one CPU block of 2 sub-blocks
    assert not h.transfer_async(1, (VLLMShapedGPUSpec([0, 1, 2]), CPULoadStoreSpec([0])))  # type: ignore[arg-type]
    assert h.get_finished() == []
    assert records == []


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
def test_reporting_handler_zero_loaded_kv_for_testing(layout: Layout) -> None:
    h = _handler(layout)
    assert h.transfer_async(1, (VLLMShapedGPUSpec([0, 1]), CPULoadStoreSpec([0])))  # type: ignore[arg-type]
    h.get_finished()
    h.zero_loaded_kv_for_testing = True
    untouched = [b.clone() for b in _block(h, layout, 2)]
    assert h.transfer_async(2, (CPULoadStoreSpec([0]), VLLMShapedGPUSpec([4, 5])))  # type: ignore[arg-type]
    assert h.get_finished() == [(2, True)]
    assert all(not b.any() for i in (4, 5) for b in _block(h, layout, i))
    assert all(b.any() for b in _block(h, layout, 0))  # the stored source is intact
    assert all(torch.equal(a, b) for a, b in zip(untouched, _block(h, layout, 2), strict=True))


def test_transfer_listener_that_raises_is_logged_and_skipped(
    records: list[TransferRecord], caplog: pytest.LogCaptureFixture
) -> None:
    def broken(record: TransferRecord) -> None:
        raise RuntimeError("listener bug")

    remove = add_transfer_listener(broken)
    try:
        h = _handler()
        assert h.transfer_async(1, (VLLMShapedGPUSpec([0, 1]), CPULoadStoreSpec([0])))  # type: ignore[arg-type]
        assert h.get_finished() == [(1, True)]
    finally:
        remove()
    assert "transfer listener" in caplog.text and "listener bug" in caplog.text
    assert [r.job_id for r in records] == [1]  # the other listener still heard it


def test_live_registry_holds_handlers_weakly() -> None:
    before = len(live_handlers())
    h = _handler()
    live.add_handler(h)
    assert live_handlers()[-1] is h
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None
    assert len(live_handlers()) == before
