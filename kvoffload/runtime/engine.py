"""The serving loop: drives an offloading manager and the swap handler step by step.

Requests that have arrived wait in a queue
(:mod:`~kvoffload.runtime.arrivals`, at most ``max_waiting_requests``), each
hinted to the manager as it joins and unhinted right before it is served, so
the manager's hint window is the queue whatever the policy. At most
:data:`ADMIT_PER_STEP` (or ``max_requests_per_step``, if more) join before a
step and as many after it, so that a step stays short however long the queue
may grow (at full speed a long queue fills over several steps); each step takes the
oldest, up to ``max_requests_per_step``, and serves each one's blocks in the order
vLLM's offloading connector uses (:mod:`~kvoffload.runtime.scheduling`);
finished transfer jobs are completed between requests
(:mod:`~kvoffload.runtime.jobs`). Every loaded block is verified byte for byte.

Commands (policy switch, pause, resume, reset) are queued from any thread and
applied by the engine thread between steps; readers get the immutable
:class:`EngineSnapshot` published after every step and command. No lock is
taken on the hot path.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Literal, cast

from kvoffload._checks import is_int
from kvoffload.backends.cpu import CPUBackend
from kvoffload.errors import ConfigError
from kvoffload.event_log import EventLog
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.policies import available_policies, policy_class
from kvoffload.runtime.arrivals import Arrivals, WaitingQueue
from kvoffload.runtime.commands import (
    Command,
    CommandKind,
    CommandResult,
    EngineStoppedError,
    apply_switch,
)
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.jobs import TransferJobs
from kvoffload.runtime.kv_store import GPUKVStore
from kvoffload.runtime.observer import EngineObserver, RequestRecord, TransferRecord, notify
from kvoffload.runtime.scheduling import RequestBlocks, RequestScheduler
from kvoffload.runtime.snapshot import EngineSnapshot, EngineState, RuntimeStats
from kvoffload.runtime.workloads import Request, Workload
from kvoffload.transfer.cpu_gpu import (
    DEFAULT_RAM_FRACTION,
    CpuGpuOffloadingHandler,
    default_max_cpu_bytes,
)
from kvoffload.transfer.faults import FaultInjectingHandler
from kvoffload.transfer.worker import OffloadingHandler, OffloadingWorker

__all__ = ["ADMIT_PER_STEP", "Engine", "EngineConfig"]

logger = logging.getLogger(__name__)

#: requests that may join the waiting queue at a time (each is hashed and
#: hinted as it joins): a step, and the commands that wait for it, stay short
ADMIT_PER_STEP = 256

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
        self.check_workload(config, workload)
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
            self._check_memory()
            handler = CpuGpuOffloadingHandler(
                gpu_block_size=config.gpu_block_size,
                cpu_block_size=config.offloaded_block_size,
                num_cpu_blocks=config.num_cpu_blocks,
                gpu_caches=self.kv.tensors,
                layouts=config.kv_layout,
                num_gpu_blocks=config.num_gpu_blocks,
            )
        if config.inject_failure_rate > 0:
            handler = FaultInjectingHandler(handler, config.inject_failure_rate, config.seed)
        self.worker = OffloadingWorker()
        self.worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
        self.worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handler)
        self._c = RuntimeStats()
        self._jobs = TransferJobs(
            self.worker,
            self.manager,
            self.kv,
            self._c,
            self._job_finished,
            self._request_finished,
        )
        self._scheduler = RequestScheduler(
            config,
            self.kv,
            self.manager,
            self._jobs,
            self._c,
            workload.trace_block_size,
            self._request_finished,
        )
        # The waiting requests, each hinted to the manager as it arrives (in
        # queue order) and unhinted right before it is served: ``_hinted``
        # holds their blocks and tickets, aligned with the queue (both FIFO).
        self._hinted: deque[tuple[Request, RequestBlocks, int]] = deque()
        self._queue = WaitingQueue(
            Arrivals(workload, config.speed), config.max_waiting_requests, on_arrival=self._hint
        )
        self._admit_per_step = max(ADMIT_PER_STEP, config.max_requests_per_step)
        self._state: EngineState = "created"
        self._policy_version = 1
        self._last_commands: Mapping[CommandKind, CommandResult] = MappingProxyType({})
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        # held by run() (stop() waits for it) and while start() starts the
        # thread; run()'s thread; one start() at a time
        self._run_lock = threading.Lock()
        self._runner: int | None = None
        self._start_lock = threading.Lock()
        self._snapshot = self._take_snapshot()

    @staticmethod
    def check_workload(config: EngineConfig, workload: Workload) -> None:
        """:class:`ConfigError` unless ``workload``'s blocks fit ``config``: a
        positive ``trace_block_size`` that ``gpu_block_size`` divides, or
        divides."""
        tbs = workload.trace_block_size
        if not is_int(tbs) or tbs <= 0:
            raise ConfigError(
                f"the workload's trace_block_size must be a positive integer (tokens), got {tbs!r}"
            )
        if tbs % config.gpu_block_size and config.gpu_block_size % tbs:
            raise ConfigError(
                f"the workload's trace_block_size ({tbs}) and gpu_block_size "
                f"({config.gpu_block_size}) must divide one another"
            )

    def _check_memory(self) -> None:
        """On a CPU device the simulated GPU cache and the CPU tier's mirror
        share the machine's memory: :class:`ConfigError` when together they
        pass the share each was checked against alone (both fitted, and the
        process could be killed for memory instead)."""
        limit = default_max_cpu_bytes() if self.kv.device.type == "cpu" else None
        if limit is None:
            return
        config = self.config
        store = sum(t.numel() * t.element_size() for t in self.kv.tensors.values())
        mirror = CpuGpuOffloadingHandler.mirror_bytes(
            self.kv.tensors,
            config.gpu_block_size,
            config.offloaded_block_size,
            config.num_cpu_blocks,
            layouts=config.kv_layout,
            num_gpu_blocks=config.num_gpu_blocks,
        )
        if store + mirror > limit:
            raise ConfigError(
                f"on the CPU, the simulated GPU KV cache ({store} bytes) and the CPU tier "
                f"({mirror} bytes) together need more than {limit} bytes "
                f"({DEFAULT_RAM_FRACTION:.0%} of this machine's memory); lower the GPU or CPU "
                "blocks (kvoffload serve: --gpu-blocks / KVOFFLOAD_GPU_BLOCKS, "
                "--num-cpu-blocks / KVOFFLOAD_NUM_CPU_BLOCKS)"
            )

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
        """Raise :class:`~kvoffload.errors.PolicyError` if ``policy`` is unknown
        (:class:`~kvoffload.errors.PolicyFailedError` if its class does not
        import)."""
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
        """Run the loop in a background thread. :class:`RuntimeError` if it
        was started already or runs in :meth:`run` or :meth:`step`;
        :class:`EngineStoppedError` once it has stopped (or is stopping)."""
        with self._start_lock:  # two threads starting it: one loop
            if self._thread is not None:
                raise RuntimeError("engine already started")
            self._drive("start()")
            try:
                # set before it starts (the loop's own stop() knows itself by
                # it); stop() reads it under the start lock, so never unstarted
                self._thread = threading.Thread(
                    target=self._run_safely, name="kvoffload-engine", daemon=True
                )
                self._state = "running"
                self._publish()
                self._thread.start()
            finally:
                self._run_lock.release()

    @property
    def thread_id(self) -> int | None:
        """The OS thread id of the loop started by :meth:`start` (None before)."""
        return self._thread.native_id if self._thread is not None else None

    def stop(self, timeout: float = 30.0) -> EngineSnapshot:
        """Stop after the current step, finish in-flight jobs, publish and return
        the final snapshot."""
        self._stop_requested = True
        self._commands.put(_STOP)
        me = threading.current_thread()
        if self._thread is me or self._runner == me.ident:
            # from the loop's own thread (an observer): it stops after this step
            return self._snapshot
        with self._start_lock:  # not a thread start() is still starting
            thread = self._thread
        if thread is None:
            if not self._run_lock.acquire(timeout=timeout):
                logger.error("engine run() did not stop within %.1f s", timeout)
                return self._snapshot
            # no run() in progress, or it has returned, having stopped the
            # engine; or start() made the thread meanwhile (it holds the lock)
            try:
                thread = self._thread
                if thread is None and self._state != "stopped":
                    self._finish()
            finally:
                self._run_lock.release()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.error("engine thread did not stop within %.1f s", timeout)
        return self._snapshot

    def run(self, max_steps: int | None = None) -> EngineSnapshot:
        """Run on the calling thread until the workload ends (state
        ``finished``), ``max_steps`` steps were taken, the engine is paused or
        :meth:`stop` is called (from any thread; the engine then stops, as
        there); paced by ``config.speed``. Finishes in-flight jobs and returns
        the snapshot. :class:`RuntimeError` while the engine runs elsewhere
        (:meth:`start`, or ``run`` on another thread);
        :class:`EngineStoppedError` once it has stopped; :class:`ConfigError`
        for a ``max_steps`` that is not a count of at least 1."""
        if max_steps is not None and not (is_int(max_steps) and max_steps >= 1):
            raise ConfigError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
        self._drive("run()")
        self._runner = threading.get_ident()
        try:
            if self._state == "created":
                self._state = "running"
            done = 0
            while (max_steps is None or done < max_steps) and not self._stop_requested:
                turn = self._turn()
                if turn in ("idle", "ended"):  # paused (or finished), or the end
                    break
                done += turn == "stepped"
            if self._stop_requested:
                self._finish()
            else:
                self._jobs.drain()
                self._publish()
        finally:
            self._runner = None
            self._run_lock.release()
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
            if not result.changed_nothing:
                self._last_commands = MappingProxyType({**self._last_commands, result.kind: result})
            # publish first: a caller woken by the future reads the snapshot
            self._publish()
            fut.set_result(result)
            if not result.changed_nothing:
                for obs in self.observers:
                    notify(obs.command_applied, result)

    def _apply(self, command: Command) -> CommandResult:
        m = self.manager
        detail: dict[str, str] = {}
        if command.kind == "switch_policy":
            detail, self._policy_version = apply_switch(m, command, self._policy_version)
        elif command.kind in ("pause", "resume"):
            before = self._state
            if command.kind == "pause" and before == "running":
                # A paused engine is a quiet one: its loads and stores finish
                # now, so every count it publishes is settled. The workload's
                # clock stops with it: nothing arrives while it is paused.
                self._jobs.drain()
                self._queue.arrivals.pause()
                self._state = "paused"
            elif command.kind == "resume" and before == "paused":
                self._queue.arrivals.resume()
                self._state = "running"
            detail = {"from": before, "to": self._state}
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
            timestamp=time.time(),
        )

    # -- the loop ----------------------------------------------------------

    def _run_safely(self) -> None:
        try:
            while not self._stop_requested:
                if self._state == "paused" or self._state == "finished":
                    self._apply_commands(block=True, timeout=0.5)
                elif self._turn() == "ended":
                    self._jobs.drain()
                    self._publish()
        except Exception:
            logger.exception("engine loop crashed; stopping")
        finally:
            self._finish()

    def _turn(self) -> Literal["stepped", "waited", "idle", "ended"]:
        """One turn of a loop: the queued commands, then a step if the engine
        runs and a request is due, else a wait for one (at most 0.5 s, in
        which commands, a pause or a stop, still take effect first)."""
        self._apply_commands(block=False)
        if self._state != "running" or self._stop_requested:
            return "idle"
        wait = self._queue.due_in()
        if wait > 0:
            self._apply_commands(block=True, timeout=min(wait, 0.5))
            return "waited"
        if not self._step():
            self._state = "finished"
            return "ended"
        return "stepped"

    def _finish(self) -> None:
        # stopped whatever the jobs do: a drain that raised (the handler that
        # crashed the loop, again) left the engine "running" for ever, and
        # every later command waiting for a loop that was gone
        try:
            self._jobs.drain()
            left = "no transfer job in flight"
        except Exception:
            logger.exception("the in-flight transfer jobs could not be finished")
            left = f"{len(self._jobs)} transfer jobs left unfinished"
        self._state = "stopped"
        self._publish()
        for obs in self.observers:
            notify(obs.close)
        self._fail_queued()
        logger.info("engine stopped after %d steps; %s", self._c.steps, left)

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

    def _hint(self, r: Request) -> None:
        blocks = self._scheduler.blocks(r)
        self._hinted.append((r, blocks, self.manager.hint(blocks.offloaded)))

    def step(self) -> bool:
        """Take one engine step; ``False`` when the workload is exhausted.
        For driving the engine by hand, as :meth:`run` does (``start``,
        ``run`` and another ``step`` are refused meanwhile, and ``stop``
        waits for it): :class:`RuntimeError` while the engine runs in
        :meth:`start`'s thread or is driven elsewhere,
        :class:`EngineStoppedError` once it has stopped. A :meth:`stop`
        from an observer during the step stops the engine after it."""
        self._drive("step()")
        self._runner = threading.get_ident()
        try:
            stepped = self._step()
            if self._stop_requested:
                self._finish()
            return stepped
        finally:
            self._runner = None
            self._run_lock.release()

    def _drive(self, what: str) -> None:
        """Take the run lock for ``what`` (``start()``, ``run()`` or
        ``step()``), the caller releasing it; or raise, holding nothing."""
        if not self._run_lock.acquire(blocking=False):
            if self._stop_requested:  # stop() holds it while it finishes
                raise EngineStoppedError(f"the engine is stopping: {what} refused")
            raise RuntimeError(
                f"the engine is already running (in run() or step() elsewhere): {what} refused"
            )
        # with the lock held: start() makes the thread holding it
        if self._thread is not None:
            self._run_lock.release()
            raise RuntimeError(
                f"the engine runs in its own thread (start()); use stop() to end it: {what} refused"
            )
        if self._state == "stopped":
            self._run_lock.release()
            raise EngineStoppedError(f"the engine has stopped: {what} refused")

    def _step(self) -> bool:
        waiting, chunk = self._queue, self._admit_per_step
        waiting.admit(at_least_one=True, limit=chunk)
        batch: list[Request] = []
        while len(batch) < self.config.max_requests_per_step:
            r = waiting.take()
            if r is None:
                break
            batch.append(r)
        # arrived meanwhile: waiting when the next step looks ahead
        waiting.admit(limit=chunk)
        if not batch:
            return False
        c = self._c
        step = c.steps + 1
        start = time.perf_counter_ns()
        for obs in self.observers:
            notify(obs.step_started, step, start)
        scheduler = self._scheduler
        policy = self.manager.policy  # commands, a switch included, come between steps
        evictions_before = dict(policy.evictions)
        self._jobs.collect()
        hinted, manager = self._hinted, self.manager
        for r in batch:
            queued, blocks, ticket = hinted.popleft()
            assert queued is r, "the hint queue is out of step with the waiting queue"
            manager.unhint(ticket)
            scheduler.serve(r, step, blocks)
        self._jobs.collect()
        end = time.perf_counter_ns()
        c.steps = step
        c.last_step_seconds = (end - start) / 1e9
        c.step_seconds_total += c.last_step_seconds
        evicted = {
            k: n - evictions_before.get(k, 0)
            for k, n in policy.evictions.items()
            if n != evictions_before.get(k, 0)
        }
        if evicted:
            count = sum(evicted.values())
            for obs in self.observers:
                notify(obs.blocks_evicted, step, count, policy.name, evicted)
        for obs in self.observers:
            notify(obs.step_finished, step, start, end, len(batch))
        self._publish()
        return True

    def _job_finished(self, record: TransferRecord) -> None:
        for obs in self.observers:
            notify(obs.transfer_finished, record)

    def _request_finished(self, record: RequestRecord) -> None:
        for obs in self.observers:
            notify(obs.request_finished, record)

    # -- snapshots -----------------------------------------------------------

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            state=self._state,
            step=self._c.steps,
            policy_version=self._policy_version,
            workload=self._workload_description,
            manager=self.manager.stats(),
            runtime=self._c.copy(),
            timestamp=time.time(),
            gpu_block_size=self.config.gpu_block_size,
            commands=self._last_commands,
        )

    def _publish(self) -> None:
        # One reference assignment: readers see the old or the new snapshot.
        self._snapshot = self._take_snapshot()
