"""Transfer jobs in flight: submitting them, and completing them in the
manager and the GPU KV store when the handler reports them finished.

A finished store completes its blocks in the manager (``success=False`` when
the job failed: nothing leaks) and releases the GPU blocks it read. A finished
load unpins its offloaded blocks; its GPU blocks are verified byte for byte
against the contents derived from their hashes, or recomputed when the job
failed (those tokens then count as computed, not as CPU hits).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvoffload.abstract import BlockHash
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.runtime.kv_store import GPUKVStore
from kvoffload.runtime.observer import Direction, RequestRecord, TransferRecord
from kvoffload.runtime.snapshot import RuntimeStats
from kvoffload.transfer.worker import OffloadingWorker, TransferSpec

__all__ = ["TransferJobs"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    direction: Direction
    #: offloaded hashes the job completes in the manager
    hashes: list[BlockHash]
    gpu_ids: list[int]
    #: GPU-block hashes of ``gpu_ids`` (for verification and recompute)
    gpu_hashes: list[BlockHash]
    submitted_ns: int
    #: a load's request, reported once the load finished
    request: RequestRecord | None


class TransferJobs:
    """The engine's jobs in flight through ``worker`` (engine thread only).

    ``counters`` are the engine's, updated as jobs are submitted and finish;
    ``on_finished`` is told about every finished job, ``on_request`` about the
    request of every finished load.
    """

    def __init__(
        self,
        worker: OffloadingWorker,
        manager: PolicyOffloadingManager,
        kv: GPUKVStore,
        counters: RuntimeStats,
        on_finished: Callable[[TransferRecord], None],
        on_request: Callable[[RequestRecord], None],
    ) -> None:
        self.worker = worker
        self.manager = manager
        self.kv = kv
        self.counters = counters
        self.on_finished = on_finished
        self.on_request = on_request
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(
        self,
        direction: Direction,
        spec: TransferSpec,
        hashes: list[BlockHash],
        gpu_ids: list[int],
        gpu_hashes: list[BlockHash],
        request: RequestRecord | None = None,
    ) -> None:
        """Start a job (a load names its ``request``); one the worker refuses
        is finished as failed at once."""
        job_id = next(self._job_ids)
        job = _Job(direction, hashes, gpu_ids, gpu_hashes, time.perf_counter_ns(), request)
        if direction == "store":
            self.counters.store_jobs += 1
        else:
            self.counters.load_jobs += 1
        if self.worker.transfer_async(job_id, spec):
            self._jobs[job_id] = job
        else:
            self._finish(job_id, job, ok=False)

    def collect(self, wait: bool = False) -> None:
        """Complete the jobs the handlers report finished; with ``wait``, poll
        until at least one finished (or none is in flight)."""
        while True:
            finished = self.worker.get_finished()
            for job_id, ok in finished:
                job = self._jobs.pop(job_id, None)
                if job is None:
                    logger.error("handler reported unknown job %d", job_id)
                    continue
                self._finish(job_id, job, ok)
            if finished or not wait or not self._jobs:
                return
            time.sleep(0.0002)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait for every job in flight to finish (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            self.collect(wait=True)
        if self._jobs:
            logger.error("%d transfer jobs still in flight after %.1f s", len(self._jobs), timeout)

    def _finish(self, job_id: int, job: _Job, ok: bool) -> None:
        c = self.counters
        kv = self.kv
        n = len(job.gpu_ids)
        nbytes = n * kv.block_bytes
        if job.direction == "store":
            self.manager.complete_store(job.hashes, success=ok)
            kv.unpin(job.gpu_ids)
            if ok:
                c.stored_gpu_blocks += n
                c.stored_bytes += nbytes
        else:
            self.manager.complete_load(job.hashes)
            if ok:
                bad = kv.verify(job.gpu_ids, job.gpu_hashes)
                if bad:
                    c.verify_failures += bad
                    logger.error(
                        "load job %d: %d of %d blocks differ from what was stored", job_id, bad, n
                    )
                c.loaded_gpu_blocks += n
                c.loaded_bytes += nbytes
                c.cpu_hit_tokens += n * kv.block_size
            else:
                # The data never arrived: recompute it so the request is
                # still served correctly, and count those tokens as computed.
                kv.compute(job.gpu_ids, job.gpu_hashes)
                c.computed_tokens += n * kv.block_size
            kv.unpin(job.gpu_ids)
        if not ok:
            c.failed_jobs += 1
        now = time.perf_counter_ns()
        self.on_finished(
            TransferRecord(job_id, job.direction, n, nbytes, job.submitted_ns, now, ok)
        )
        request = job.request
        if request is not None:
            if not ok:  # its loaded tokens were computed after all
                tokens = request.cpu_hit_tokens
                request = replace(
                    request, cpu_hit_tokens=0, computed_tokens=request.computed_tokens + tokens
                )
            self.on_request(replace(request, finished_ns=now))
