"""kvoffload's copy handler as vLLM's worker drives it.

:class:`ReportingHandler` wraps a
:class:`~kvoffload.transfer.CpuGpuOffloadingHandler` and is the one place
where a finished job's direction, size, duration and outcome are known: each
becomes a :class:`~kvoffload.runtime.observer.TransferRecord` handed to the
process's transfer listeners (:func:`kvoffload.vllm.live.add_transfer_listener`).
It imports neither vLLM nor torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvoffload.runtime.observer import Direction, TransferRecord
from kvoffload.transfer.worker import OffloadingHandler, TransferResult, TransferSpec
from kvoffload.vllm.live import report

if TYPE_CHECKING:
    from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

__all__ = ["ReportingHandler"]


class ReportingHandler(OffloadingHandler):
    """Forwards every job to ``inner`` and reports each one it finished.

    Jobs are accepted or refused exactly as ``inner`` does (specs by
    ``medium()`` and ``block_ids``, vLLM's or kvoffload's). ``blocks`` of a
    record counts GPU blocks, ``nbytes`` their bytes over all layers, the
    duration runs from submit to the poll that saw the job finished.
    """

    def __init__(self, inner: CpuGpuOffloadingHandler) -> None:
        self.inner = inner
        # job id -> (direction, GPU block ids, submit time)
        self._jobs: dict[int, tuple[Direction, list[int], int]] = {}
        #: Test-only: overwrite the GPU blocks of every finished load with
        #: zeros before vLLM computes with them, so that a test can show that
        #: outputs depend on what the tier loaded. Never set it in serving.
        self.zero_loaded_kv_for_testing = False

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        submitted = time.perf_counter_ns()
        if not self.inner.transfer_async(job_id, spec):
            return False
        src, dst = spec
        # accepted, so the media are GPU->CPU or CPU->GPU
        direction: Direction = "store" if src.medium() == "GPU" else "load"
        ids = (src if direction == "store" else dst).block_ids  # type: ignore[attr-defined]
        # vLLM's specs hold numpy arrays, a duck-typed one may hold a list
        # (whose missing tolist() lost the job after its copy was made)
        gpu_ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        self._jobs[job_id] = (direction, gpu_ids, submitted)
        return True

    def get_finished(self) -> list[TransferResult]:
        finished = self.inner.get_finished()
        now = time.perf_counter_ns()
        for job_id, ok in finished:
            direction, gpu_ids, submitted = self._jobs.pop(job_id)
            if direction == "load" and ok and self.zero_loaded_kv_for_testing:
                self._zero_gpu_blocks(gpu_ids)
            n = len(gpu_ids)
            report(
                TransferRecord(
                    job_id, direction, n, n * self.inner.gpu_block_bytes, submitted, now, ok
                )
            )
        return finished

    def _zero_gpu_blocks(self, gpu_ids: list[int]) -> None:
        for tensor, layout in zip(self.inner.gpu_tensors, self.inner.layouts.values(), strict=True):
            if layout == "kv_first":
                tensor[:, gpu_ids] = 0
            else:
                tensor[gpu_ids] = 0
