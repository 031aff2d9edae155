"""The serving loop: drives an offloading manager and the swap handler step by step.

Per step, for each scheduled request, in the order vLLM's offloading
connector uses: ``touch`` the request's offloaded hashes; ``lookup`` past the
GPU prefix hit; ``prepare_load`` and submit a CPU->GPU job for CPU hits;
"compute" the remaining blocks (contents derived from the block hash);
``prepare_store`` the request's new offloaded blocks and submit GPU->CPU jobs;
then poll ``get_finished`` and ``complete_load`` / ``complete_store``. Every
loaded block is verified byte for byte. A failed store completes with
``success=False``; a failed load is recomputed.

Commands (policy switch, pause, resume, reset) are queued from any thread and
applied by the engine thread between steps; readers get the immutable
:class:`EngineSnapshot` published after every step. No lock is taken on the
hot path.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Literal, cast

from kvoffload.abstract import BlockHash
from kvoffload.backends.cpu import CPUBackend
from kvoffload.errors import ConfigError
from kvoffload.event_log import EventLog
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.policies import available_policies, policy_class
from kvoffload.runtime.commands import (
    Command,
    CommandResult,
    EngineStoppedError,
    check_version,
)
from kvoffload.runtime.kv_store import GPUKVStore
from kvoffload.runtime.observer import (
    Direction,
    EngineObserver,
    RequestRecord,
    TransferRecord,
)
from kvoffload.runtime.snapshot import EngineSnapshot, EngineState, RuntimeStats
from kvoffload.runtime.workloads import Request, Workload, engine_block_hashes
from kvoffload.transfer.layout import Layout
from kvoffload.transfer.worker import OffloadingHandler, OffloadingWorker, TransferSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Shape of the simulated model and of both cache tiers.

    The defaults make a small, fast engine: 2 layers of a tiny model, a GPU
    prefix cache of 512 blocks and a CPU tier of 2048 offloaded blocks.
    """

    policy: str = "lru"
    #: offloaded (CPU) blocks in the CPU tier
    num_cpu_blocks: int = 2048
    #: blocks of the GPU KV cache (its prefix cache reuses the unpinned ones)
    num_gpu_blocks: int = 512
    #: tokens per GPU block
    gpu_block_size: int = 16
    #: tokens per offloaded block; a multiple of ``gpu_block_size``
    offloaded_block_size: int = 64
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    kv_layout: Layout = "kv_first"
    device: str = "auto"
    #: requests scheduled per engine step
    max_requests_per_step: int = 4
    event_log_capacity: int = 10_000
    #: trace seconds per wall second (None = as fast as possible)
    speed: float | None = None
    #: fraction of transfer jobs reported failed on purpose (chaos testing)
    inject_failure_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        policy_class(self.policy)
        for name in (
            "num_cpu_blocks",
            "num_gpu_blocks",
            "gpu_block_size",
            "offloaded_block_size",
            "max_requests_per_step",
            "event_log_capacity",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.offloaded_block_size % self.gpu_block_size:
            raise ConfigError(
                f"offloaded_block_size ({self.offloaded_block_size}) must be a multiple of "
                f"gpu_block_size ({self.gpu_block_size})"
            )
        if self.num_gpu_blocks < self.block_factor:
            # a request keeps at least one offloaded block, and all of it
            # must fit on the GPU at once
            raise ConfigError(
                f"num_gpu_blocks ({self.num_gpu_blocks}) must hold one offloaded block "
                f"({self.block_factor} GPU blocks); raise num_gpu_blocks or lower "
                "offloaded_block_size"
            )
        if self.speed is not None and not self.speed > 0:
            raise ConfigError(f"speed must be > 0 or None, got {self.speed!r}")
        if not 0.0 <= self.inject_failure_rate <= 1.0:
            raise ConfigError(
                f"inject_failure_rate must be within [0, 1], got {self.inject_failure_rate!r}"
            )

    @property
    def block_factor(self) -> int:
        """GPU blocks per offloaded block."""
        return self.offloaded_block_size // self.gpu_block_size


class _FaultInjector(OffloadingHandler):
    """Wraps a handler and reports a seeded fraction of its jobs as failed."""

    def __init__(self, inner: OffloadingHandler, rate: float, seed: int) -> None:
        self.inner = inner
        self.rate = rate
        self._rng = random.Random(seed)
        self._doomed: set[int] = set()

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        ok = self.inner.transfer_async(job_id, spec)
        if ok and self._rng.random() < self.rate:
            self._doomed.add(job_id)
        return ok

    def get_finished(self) -> list[tuple[int, bool]]:
        out = []
        for job_id, ok in self.inner.get_finished():
            if job_id in self._doomed:
                self._doomed.discard(job_id)
                ok = False
            out.append((job_id, ok))
        return out


@dataclass(slots=True)
class _Job:
    direction: Direction
    #: offloaded hashes the job completes in the manager
    hashes: list[BlockHash]
    gpu_ids: list[int]
    #: GPU-block hashes of ``gpu_ids`` (for verification and recompute)
    gpu_hashes: list[BlockHash]
    submitted_ns: int


_RUNTIME_FIELDS = tuple(f.name for f in fields(RuntimeStats))


@dataclass(slots=True)
class _Counters:
    """Mutable twin of :class:`RuntimeStats`, written by the engine thread only."""

    steps: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    computed_tokens: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    failed_jobs: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    verify_failures: int = 0
    step_seconds_total: float = 0.0
    last_step_seconds: float = 0.0

    def freeze(self) -> RuntimeStats:
        return RuntimeStats(**{name: getattr(self, name) for name in _RUNTIME_FIELDS})


_STOP = object()
#: what the command queue holds besides ``_STOP``
_Queued = tuple[Command, "concurrent.futures.Future[CommandResult]"]


class Engine:
    """Runs a workload through a GPU KV store, an offloading manager and the
    CPU<->GPU swap handler. Use :meth:`run` on the calling thread, or
    :meth:`start` / :meth:`stop` for a background thread."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        workload: Workload | None = None,
        observers: Sequence[EngineObserver] = (),
        *,
        handler: OffloadingHandler | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        if workload is None:
            from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
            from kvoffload.runtime.workloads import loop

            workload = loop(
                SyntheticWorkload(
                    SyntheticConfig(seed=config.seed, trace_block_size=config.offloaded_block_size)
                )
            )
        tbs = workload.trace_block_size
        if tbs % config.gpu_block_size and config.gpu_block_size % tbs:
            raise ConfigError(
                f"the workload's block size {tbs} and gpu_block_size {config.gpu_block_size} "
                "must divide one another"
            )
        self.workload = workload
        # Described once: a trace's description scans every request, and a
        # snapshot is taken after every step.
        self._workload_description = workload.describe()
        self.observers = tuple(observers)
        self.kv = GPUKVStore(
            num_blocks=config.num_gpu_blocks,
            block_size=config.gpu_block_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_size=config.head_size,
            dtype=config.dtype,
            layout=config.kv_layout,
            device=config.device,
        )
        backend = CPUBackend(config.offloaded_block_size, config.num_cpu_blocks)
        self.manager = PolicyOffloadingManager(
            backend,
            policy=config.policy,
            enable_events=True,
            event_log_capacity=config.event_log_capacity,
        )
        if handler is None:
            from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

            handler = CpuGpuOffloadingHandler(
                gpu_block_size=config.gpu_block_size,
                cpu_block_size=config.offloaded_block_size,
                num_cpu_blocks=config.num_cpu_blocks,
                gpu_caches=self.kv.tensors,
                layouts=config.kv_layout,
                num_gpu_blocks=config.num_gpu_blocks,
            )
        if config.inject_failure_rate > 0:
            handler = _FaultInjector(handler, config.inject_failure_rate, config.seed)
        self.worker = OffloadingWorker()
        self.worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
        self.worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handler)
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count(1)
        self._c = _Counters()
        self._state: EngineState = "created"
        self._policy_version = 1
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._requests: Iterator[Request] | None = None
        self._pending_request: Request | None = None
        self._pace_origin: tuple[float, float] | None = None
        self._step_evictions = 0
        self._snapshot = self._take_snapshot()

    # -- public surface ----------------------------------------------------

    @property
    def event_log(self) -> EventLog:
        assert self.manager.event_log is not None
        return self.manager.event_log

    @property
    def available_policies(self) -> tuple[str, ...]:
        return available_policies()

    @property
    def workload_description(self) -> str:
        return self._workload_description

    @property
    def state(self) -> EngineState:
        return self._state

    def snapshot(self) -> EngineSnapshot:
        """The latest published snapshot (immutable; safe from any thread)."""
        return self._snapshot

    def validate_policy(self, policy: str) -> None:
        """Raise :class:`~kvoffload.errors.PolicyError` if ``policy`` is unknown."""
        policy_class(policy)

    def switch_policy(
        self, policy: str, expected_version: int | None = None
    ) -> concurrent.futures.Future[CommandResult]:
        """Queue a live policy switch. Unknown policies raise at once; a stale
        ``expected_version`` fails the future with :class:`VersionConflictError`."""
        self.validate_policy(policy)
        return self._submit(
            Command("switch_policy", policy=policy.lower(), expected_version=expected_version)
        )

    def pause(self) -> concurrent.futures.Future[CommandResult]:
        return self._submit(Command("pause"))

    def resume(self) -> concurrent.futures.Future[CommandResult]:
        return self._submit(Command("resume"))

    def reset(self) -> concurrent.futures.Future[CommandResult]:
        """Queue a reset: both cache tiers drop every unpinned block (counters stay)."""
        return self._submit(Command("reset"))

    def start(self) -> None:
        """Run the loop in a background thread."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(
            target=self._run_safely, name="kvoffload-engine", daemon=True
        )
        self._state = "running"
        self._publish()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> EngineSnapshot:
        """Stop after the current step, finish in-flight jobs, publish and return
        the final snapshot."""
        self._stop_requested = True
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.1f s", timeout)
        else:
            self._finish()
        return self._snapshot

    def run(self, max_steps: int | None = None) -> EngineSnapshot:
        """Run on the calling thread until the workload ends or ``max_steps``
        steps were taken (paced by ``config.speed``); finishes in-flight jobs
        and returns the snapshot."""
        if self._state == "created":
            self._state = "running"
        done = 0
        while max_steps is None or done < max_steps:
            self._apply_commands(block=False)
            if self._state == "paused":
                break
            wait = self._due_in()
            if wait > 0:
                # commands sent meanwhile (a pause) take effect before the step
                self._apply_commands(block=True, timeout=wait)
                continue
            if not self.step():
                break
            done += 1
        self._drain_jobs()
        self._publish()
        return self._snapshot

    # -- command handling ----------------------------------------------------

    def _submit(self, command: Command) -> concurrent.futures.Future[CommandResult]:
        fut: concurrent.futures.Future[CommandResult] = concurrent.futures.Future()
        if self._state != "stopped":
            self._commands.put((command, fut))
        # Checked after the put too: an engine that stopped in between may
        # have run its last drain before this command was queued.
        if self._state == "stopped":
            self._fail_queued()
            if not fut.done():
                fut.set_exception(
                    EngineStoppedError("the engine has stopped; commands are not applied")
                )
        return fut

    def _apply_commands(self, block: bool, timeout: float | None = None) -> None:
        while True:
            try:
                item = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            if item is _STOP:
                self._stop_requested = True
                continue
            command, fut = cast(_Queued, item)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = self._apply(command)
            except Exception as e:  # delivered to the caller, the loop goes on
                fut.set_exception(e)
                continue
            # publish first: a caller woken by the future reads the snapshot
            self._publish()
            fut.set_result(result)
            for obs in self.observers:
                self._notify(obs.command_applied, result)

    def _apply(self, command: Command) -> CommandResult:
        m = self.manager
        detail: dict[str, str] = {}
        if command.kind == "switch_policy":
            assert command.policy is not None
            check_version(command.expected_version, self._policy_version)
            old = m.switch_policy(command.policy)
            self._policy_version += 1
            detail = {"from": old, "to": m.policy_name}
        elif command.kind == "pause":
            if self._state == "running":
                self._state = "paused"
        elif command.kind == "resume":
            if self._state == "paused":
                self._state = "running"
        elif command.kind == "reset":
            evicted = m.clear()
            gpu = self.kv.clear()
            detail = {"cpu_blocks_evicted": str(len(evicted)), "gpu_blocks_dropped": str(gpu)}
        logger.info("applied %s at step %d %s", command.kind, self._c.steps, detail or "")
        return CommandResult(
            kind=command.kind,
            applied_at_step=self._c.steps,
            policy=m.policy_name,
            policy_version=self._policy_version,
            detail=detail,
        )

    # -- the loop ----------------------------------------------------------

    def _run_safely(self) -> None:
        try:
            while not self._stop_requested:
                if self._state == "paused" or self._state == "finished":
                    self._apply_commands(block=True, timeout=0.5)
                    continue
                self._apply_commands(block=False)
                if self._state != "running" or self._stop_requested:
                    continue
                wait = self._due_in()
                if wait > 0:
                    self._apply_commands(block=True, timeout=min(wait, 0.5))
                    continue
                if not self.step():
                    self._drain_jobs()
                    self._state = "finished"
                    self._publish()
        except Exception:
            logger.exception("engine loop crashed; stopping")
        finally:
            self._finish()

    def _finish(self) -> None:
        self._drain_jobs()
        self._state = "stopped"
        self._publish()
        for obs in self.observers:
            self._notify(obs.close)
        self._fail_queued()
        logger.info("engine stopped after %d steps; no transfer job in flight", self._c.steps)

    def _fail_queued(self) -> None:
        """Fail whatever is still queued so no caller waits forever."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                _, fut = cast(_Queued, item)
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(
                        EngineStoppedError("the engine stopped before applying the command")
                    )

    def _next_request(self) -> Request | None:
        if self._pending_request is not None:
            r, self._pending_request = self._pending_request, None
            return r
        if self._requests is None:
            self._requests = iter(self.workload)
        return next(self._requests, None)

    def _due_in(self) -> float:
        """Seconds until the next request is due under pacing (0 if now)."""
        if self.config.speed is None:
            return 0.0
        r = self._next_request()
        if r is None:
            return 0.0
        self._pending_request = r
        now = time.monotonic()
        if self._pace_origin is None:
            self._pace_origin = (now, r.arrival_time)
        start, first = self._pace_origin
        return max(0.0, start + (r.arrival_time - first) / self.config.speed - now)

    def step(self) -> bool:
        """Take one engine step; ``False`` when the workload is exhausted."""
        batch: list[Request] = []
        while len(batch) < self.config.max_requests_per_step:
            if batch and self._due_in() > 0:
                break
            r = self._next_request()
            if r is None:
                break
            batch.append(r)
        if not batch:
            return False
        c = self._c
        step = c.steps + 1
        start = time.perf_counter_ns()
        for obs in self.observers:
            self._notify(obs.step_started, step, start)
        self._step_evictions = 0
        self._collect_finished()
        for r in batch:
            self._serve(r, step)
        self._collect_finished()
        end = time.perf_counter_ns()
        c.steps = step
        c.last_step_seconds = (end - start) / 1e9
        c.step_seconds_total += c.last_step_seconds
        if self._step_evictions:
            for obs in self.observers:
                self._notify(
                    obs.blocks_evicted, step, self._step_evictions, self.manager.policy_name
                )
        for obs in self.observers:
            self._notify(obs.step_finished, step, start, end, len(batch))
        self._publish()
        return True

    # -- one request ---------------------------------------------------------

    def _serve(self, r: Request, step: int) -> None:
        cfg = self.config
        kv = self.kv
        m = self.manager
        k = cfg.block_factor
        bs = cfg.gpu_block_size
        gpu_hashes = engine_block_hashes(
            r.block_ids,
            trace_block_size=self.workload.trace_block_size,
            engine_block_size=bs,
            num_tokens=r.input_length,
        )
        # A request larger than the GPU cache cannot be prefilled at once;
        # keep the prefix that fits (counted in the prompt tokens).
        limit = max(k, (kv.num_blocks // 2) // k * k)
        if len(gpu_hashes) > limit:
            gpu_hashes = gpu_hashes[:limit]
        n = len(gpu_hashes)
        offloaded = [gpu_hashes[(j + 1) * k - 1] for j in range(n // k)]
        if offloaded:
            m.touch(offloaded)
        # Make sure the request's blocks fit, finishing jobs if needed.
        g = kv.prefix_hit(gpu_hashes)
        hit_ids = kv.pin_cached(gpu_hashes[:g])
        while kv.available() < n - g and self._jobs:
            self._collect_finished(wait=True)
        if kv.available() < n - g:  # pragma: no cover - prevented by the limit above
            kv.unpin(hit_ids)
            raise ConfigError(
                f"the GPU cache ({kv.num_blocks} blocks) cannot hold a request of {n} blocks"
            )
        # CPU tier: lookup past the GPU hit, starting at the offloaded block
        # that holds the first GPU miss.
        first_off = g // k
        cpu_hits = m.lookup(offloaded[first_off:]) if first_off < len(offloaded) else 0
        load_end = (first_off + cpu_hits) * k  # GPU blocks covered after loading
        loaded = max(0, load_end - g)
        load_ids: list[int] = []
        if loaded:
            load_hashes = offloaded[first_off : first_off + cpu_hits]
            cpu_spec = m.prepare_load(load_hashes)
            load_ids = kv.allocate(gpu_hashes[g:load_end])
            # The GPU hit may end inside the first offloaded block: the
            # handler skips its leading sub-blocks (vLLM defect 7).
            self._submit_job(
                "load",
                (cpu_spec, GPULoadStoreSpec(load_ids)),
                load_hashes,
                load_ids,
                gpu_hashes[g:load_end],
            )
        else:
            load_end = g
        # "Compute" what neither tier had.
        comp_ids = kv.allocate(gpu_hashes[load_end:])
        kv.compute(comp_ids, gpu_hashes[load_end:])
        # Store the request's new offloaded blocks (those not loaded).
        store_from = max(first_off + cpu_hits, g // k)
        out = m.prepare_store(offloaded[store_from:]) if store_from < len(offloaded) else None
        all_ids = hit_ids + load_ids + comp_ids
        if out is not None:
            self._step_evictions += len(out.block_hashes_evicted)
            if out.block_hashes_to_store:
                pos = {h: j for j, h in enumerate(offloaded)}
                ids: list[int] = []
                sub_hashes: list[BlockHash] = []
                for h in out.block_hashes_to_store:
                    j = pos[h]
                    ids.extend(all_ids[j * k : (j + 1) * k])
                    sub_hashes.extend(gpu_hashes[j * k : (j + 1) * k])
                kv.pin(ids)  # the store job reads them until it finishes
                self._submit_job(
                    "store",
                    (GPULoadStoreSpec(ids), out.store_spec),
                    list(out.block_hashes_to_store),
                    ids,
                    sub_hashes,
                )
        kv.unpin(hit_ids)
        kv.unpin(comp_ids)
        c = self._c
        c.requests += 1
        c.prompt_tokens += n * bs
        c.gpu_hit_tokens += g * bs
        # The loaded tokens are counted when their job finishes (as CPU hits,
        # or as computed if it failed), so no counter ever goes down; until
        # then the three outcomes sum to less than prompt_tokens.
        c.computed_tokens += (n - g - loaded) * bs
        if self.observers:
            rec = RequestRecord(
                r.request_id, step, n * bs, g * bs, loaded * bs, (n - g - loaded) * bs
            )
            for obs in self.observers:
                self._notify(obs.request_finished, rec)

    # -- transfer jobs -------------------------------------------------------

    def _submit_job(
        self,
        direction: Direction,
        spec: TransferSpec,
        hashes: list[BlockHash],
        gpu_ids: list[int],
        gpu_hashes: list[BlockHash],
    ) -> None:
        job_id = next(self._job_ids)
        job = _Job(direction, hashes, gpu_ids, gpu_hashes, time.perf_counter_ns())
        if direction == "store":
            self._c.store_jobs += 1
        else:
            self._c.load_jobs += 1
        if self.worker.transfer_async(job_id, spec):
            self._jobs[job_id] = job
        else:
            self._finish_job(job_id, job, ok=False)

    def _collect_finished(self, wait: bool = False) -> None:
        """Complete the jobs the handlers report finished; with ``wait``, poll
        until at least one finished (or none is in flight)."""
        while True:
            finished = self.worker.get_finished()
            for job_id, ok in finished:
                job = self._jobs.pop(job_id, None)
                if job is None:
                    logger.error("handler reported unknown job %d", job_id)
                    continue
                self._finish_job(job_id, job, ok)
            if finished or not wait or not self._jobs:
                return
            time.sleep(0.0002)

    def _finish_job(self, job_id: int, job: _Job, ok: bool) -> None:
        c = self._c
        m = self.manager
        kv = self.kv
        n = len(job.gpu_ids)
        nbytes = n * kv.block_bytes
        if job.direction == "store":
            m.complete_store(job.hashes, success=ok)
            kv.unpin(job.gpu_ids)
            if ok:
                c.stored_blocks += n
                c.stored_bytes += nbytes
        else:
            m.complete_load(job.hashes)
            if ok:
                bad = kv.verify(job.gpu_ids, job.gpu_hashes)
                if bad:
                    c.verify_failures += bad
                    logger.error(
                        "load job %d: %d of %d blocks differ from what was stored", job_id, bad, n
                    )
                c.loaded_blocks += n
                c.loaded_bytes += nbytes
                c.cpu_hit_tokens += n * self.config.gpu_block_size
            else:
                # The data never arrived: recompute it so the request is
                # still served correctly, and count those tokens as computed.
                kv.compute(job.gpu_ids, job.gpu_hashes)
                c.computed_tokens += n * self.config.gpu_block_size
            kv.unpin(job.gpu_ids)
        if not ok:
            c.failed_jobs += 1
        if self.observers:
            rec = TransferRecord(
                job_id, job.direction, n, nbytes, job.submitted_ns, time.perf_counter_ns(), ok
            )
            for obs in self.observers:
                self._notify(obs.transfer_finished, rec)

    def _drain_jobs(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            self._collect_finished(wait=True)
        if self._jobs:
            logger.error("%d transfer jobs still in flight after %.1f s", len(self._jobs), timeout)

    # -- snapshots -----------------------------------------------------------

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            state=self._state,
            step=self._c.steps,
            policy_version=self._policy_version,
            workload=self._workload_description,
            manager=self.manager.stats(),
            runtime=self._c.freeze(),
            timestamp=time.time(),
        )

    def _publish(self) -> None:
        # One reference assignment: readers see the old or the new snapshot.
        self._snapshot = self._take_snapshot()

    def _notify(self, hook: object, *args: object) -> None:
        try:
            hook(*args)  # type: ignore[operator]
        except Exception:
            logger.exception("engine observer %r failed; ignoring", hook)
