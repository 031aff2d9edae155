"""The engine on its background thread: snapshots, queued commands, stop.

Every wait is a bounded poll; the only fixed sleep is the short window in
which a paused engine must not take a step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvoffload.errors import ConfigError, PolicyError
from kvoffload.runtime import CommandResult, EngineObserver
from kvoffload.runtime.commands import EngineStoppedError, VersionConflictError
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.snapshot import EngineSnapshot
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.workloads import Workload, loop
from kvoffload.transfer.memory import InMemoryOffloadingHandler

BLOCK = 64
TIMEOUT = 20.0  # generous bound for any single wait; passing runs take milliseconds


def config(**overrides: object) -> EngineConfig:
    args: dict[str, object] = {
        "gpu_block_size": 16,
        "offloaded_block_size": BLOCK,
        "num_gpu_blocks": 64,
        "num_cpu_blocks": 32,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_size": 8,
        "max_requests_per_step": 2,
    }
    args.update(overrides)
    return EngineConfig(**args)  # type: ignore[arg-type]


def endless_workload() -> Workload:
    return loop(
        SyntheticWorkload(
            SyntheticConfig(
                seed=5, num_requests=100, trace_block_size=BLOCK, open_chats=8, num_documents=20
            )
        )
    )


def endless() -> Engine:
    return Engine(config(), endless_workload())


def wait_for(engine: Engine, ok: Callable[[EngineSnapshot], bool]) -> EngineSnapshot:
    deadline = time.monotonic() + TIMEOUT
    while True:
        snap = engine.snapshot()
        if ok(snap):
            return snap
        if time.monotonic() > deadline:
            pytest.fail(f"engine did not get there in {TIMEOUT} s; last snapshot {snap}")
        time.sleep(0.005)


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = endless()
    yield e
    e.stop(timeout=TIMEOUT)


def test_engine_thread_publishes_advancing_snapshots(engine: Engine) -> None:
    assert engine.snapshot().state == "created"
    engine.start()
    with pytest.raises(RuntimeError, match="already started"):
        engine.start()
    first = wait_for(engine, lambda s: s.step >= 3)
    assert first.state == "running"
    later = wait_for(engine, lambda s: s.step > first.step + 3)
    assert later.runtime.requests > first.runtime.requests
    assert later.timestamp >= first.timestamp
    assert later.manager.counters.lookups >= first.manager.counters.lookups
    assert later.policy_version == 1


def test_engine_thread_applies_policy_switches_with_versions(engine: Engine) -> None:
    engine.start()
    wait_for(engine, lambda s: s.step >= 1)
    result = engine.switch_policy("arc", expected_version=1).result(timeout=TIMEOUT)
    assert (result.policy, result.policy_version) == ("arc", 2)
    assert engine.snapshot().policy_version >= 2
    stale = engine.switch_policy("lru", expected_version=1)
    error = stale.exception(timeout=TIMEOUT)
    assert isinstance(error, VersionConflictError)
    assert (error.expected, error.current) == (1, 2)
    # the failed switch changed nothing
    snap = wait_for(engine, lambda s: s.step > result.applied_at_step)
    assert (snap.manager.policy, snap.policy_version) == ("arc", 2)
    with pytest.raises(PolicyError):
        engine.switch_policy("no-such-policy")
    again = engine.switch_policy("lru", expected_version=2).result(timeout=TIMEOUT)
    assert (again.policy, again.policy_version) == ("lru", 3)


def test_engine_thread_pause_resume_and_reset(engine: Engine) -> None:
    engine.start()
    wait_for(engine, lambda s: s.step >= 5 and s.manager.used > 0)
    paused = engine.pause().result(timeout=TIMEOUT)
    snap = wait_for(engine, lambda s: s.state == "paused")
    assert snap.step == paused.applied_at_step
    # its jobs finished at the pause: every count is settled
    assert (snap.manager.in_flight, snap.manager.pinned) == (0, 0)
    rt = snap.runtime
    assert (
        rt.gpu_hit_tokens + rt.cpu_hit_tokens + rt.computed_tokens + rt.truncated_tokens
        == rt.prompt_tokens
    )
    time.sleep(0.2)  # a paused engine takes no step
    assert engine.snapshot().step == snap.step
    assert engine.state == "paused"

    before = engine.snapshot()
    gpu_cached = engine.kv.cached_blocks  # safe to read: the engine thread is paused
    assert gpu_cached > 0
    reset = engine.reset().result(timeout=TIMEOUT)
    after = engine.snapshot()
    assert reset.applied_at_step == before.step == after.step
    assert int(reset.detail["cpu_blocks_evicted"]) > 0
    # both tiers are empty: no job is in flight while paused
    m = after.manager
    assert m.used == m.pinned + m.in_flight == 0
    assert m.used + m.free == m.capacity
    kv = engine.kv
    assert kv.cached_blocks == kv.num_blocks - kv.available()
    # the GPU prefix cache is dropped too (docs/api.md), every cached block
    assert kv.cached_blocks == 0 and int(reset.detail["gpu_blocks_dropped"]) == gpu_cached
    # counters are kept; the reset's evictions are counted
    assert after.runtime == before.runtime
    assert after.manager.counters.store_blocks == before.manager.counters.store_blocks
    evicted = sum(after.manager.counters.evictions.values()) - sum(
        before.manager.counters.evictions.values()
    )
    assert evicted == int(reset.detail["cpu_blocks_evicted"])

    engine.resume().result(timeout=TIMEOUT)
    resumed = wait_for(engine, lambda s: s.step > after.step + 2)
    assert resumed.state == "running"
    assert resumed.runtime.requests > after.runtime.requests
    assert resumed.manager.used > 0


def test_engine_thread_stop_returns_a_settled_final_snapshot(engine: Engine) -> None:
    engine.start()
    wait_for(engine, lambda s: s.step >= 5)
    final = engine.stop(timeout=TIMEOUT)
    assert final.state == "stopped"
    assert engine.state == "stopped"
    m = final.manager
    assert (m.in_flight, m.pinned) == (0, 0)
    assert m.used + m.free == m.capacity
    rt = final.runtime
    assert (
        rt.gpu_hit_tokens + rt.cpu_hit_tokens + rt.computed_tokens + rt.truncated_tokens
        == rt.prompt_tokens
    )
    assert rt.verify_failures == 0
    # nothing runs any more
    time.sleep(0.05)
    assert engine.snapshot() == final
    assert engine.kv.available() == engine.kv.num_blocks

    for future in (engine.pause(), engine.resume(), engine.reset(), engine.switch_policy("arc")):
        assert isinstance(future.exception(timeout=TIMEOUT), EngineStoppedError)
    with pytest.raises(PolicyError):  # still checked before anything is queued
        engine.switch_policy("no-such-policy")
    assert engine.stop(timeout=TIMEOUT).state == "stopped"


def test_engine_stop_fails_commands_that_were_never_applied() -> None:
    engine = endless()
    queued = [engine.switch_policy("arc"), engine.pause()]
    final = engine.stop()
    assert final.state == "stopped"
    assert final.step == 0
    for future in queued:
        assert isinstance(future.exception(timeout=0), EngineStoppedError)
    assert isinstance(engine.reset().exception(timeout=0), EngineStoppedError)


def test_engine_thread_stops_while_paused(engine: Engine) -> None:
    engine.start()
    engine.pause().result(timeout=TIMEOUT)
    final = engine.stop(timeout=TIMEOUT)
    assert final.state == "stopped"
    assert final.manager.in_flight == 0


def test_engine_thread_finishes_a_finite_workload() -> None:
    workload = SyntheticWorkload(
        SyntheticConfig(seed=2, num_requests=30, trace_block_size=BLOCK, open_chats=4)
    )
    engine = Engine(config(), workload)
    engine.start()
    done = wait_for(engine, lambda s: s.state == "finished")
    assert done.runtime.requests == 30
    assert done.manager.in_flight == 0
    # a finished engine still applies commands
    result = engine.switch_policy("arc").result(timeout=TIMEOUT)
    assert result.applied_at_step == done.step
    final = engine.stop(timeout=TIMEOUT)
    assert (final.state, final.step, final.manager.policy) == ("stopped", done.step, "arc")


class StopBeforePut:
    """Stands in for the engine's command queue and stops the engine at the
    first put: the interleaving where a command passes the "stopped" check,
    then the engine finishes (failing what was queued), then the command is
    queued."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inner = engine._commands

    def put(self, item: object) -> None:
        self.engine._commands = self.inner
        self.engine.stop(timeout=TIMEOUT)
        self.inner.put(item)


def test_engine_command_racing_with_stop_still_fails() -> None:
    # Used to be left in the queue forever: a caller waiting on it hung.
    engine = endless()
    engine._commands = StopBeforePut(engine)  # type: ignore[assignment]
    future = engine.pause()
    assert engine.state == "stopped"
    assert isinstance(future.exception(timeout=1.0), EngineStoppedError)


# --------------------------------------------------------------------------- run() on a thread


def run_in_thread(engine: Engine, **kwargs: object) -> tuple[threading.Thread, list[BaseException]]:
    """``engine.run(**kwargs)`` on a thread of its own; what it raised."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            engine.run(**kwargs)  # type: ignore[arg-type]
        except BaseException as e:  # handed to the test
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, raised


def test_stop_ends_a_run_on_another_thread() -> None:
    # stop() once left run() stepping an engine it called stopped, for ever
    engine = endless()
    thread, raised = run_in_thread(engine)
    wait_for(engine, lambda s: s.step >= 5)
    final = engine.stop(timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert not thread.is_alive() and raised == []
    assert final.state == engine.state == "stopped"
    assert (final.manager.in_flight, final.manager.pinned) == (0, 0)
    time.sleep(0.1)
    assert engine.snapshot().step == final.step  # no step after the stop


def test_run_is_refused_while_the_engine_runs_elsewhere() -> None:
    # run() beside start()'s thread crashed both ("the hint queue is out of
    # step with the waiting queue") and stopped the engine
    engine = endless()
    engine.start()
    wait_for(engine, lambda s: s.step >= 2)
    with pytest.raises(RuntimeError, match=r"its own thread \(start\(\)\)"):
        engine.run(max_steps=50)
    assert engine.state == "running"
    engine.stop(timeout=TIMEOUT)

    engine = endless()
    thread, raised = run_in_thread(engine)
    wait_for(engine, lambda s: s.step >= 2)
    with pytest.raises(
        RuntimeError, match=r"already running \(in run\(\) or step\(\) elsewhere\): run\(\) refused"
    ):
        engine.run(max_steps=5)
    with pytest.raises(RuntimeError, match=r"start\(\) refused"):
        engine.start()
    engine.stop(timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert raised == [] and engine.state == "stopped"


def test_a_stopped_engine_does_not_run_again() -> None:
    engine = endless()
    engine.run(max_steps=3)
    engine.stop(timeout=TIMEOUT)
    with pytest.raises(EngineStoppedError, match=r"has stopped: run\(\) refused"):
        engine.run(max_steps=5)
    assert (engine.state, engine.snapshot().step) == ("stopped", 3)


def test_run_to_the_end_of_a_workload_is_finished() -> None:
    # as on the engine's thread (and for /readyz); run() left it "running"
    workload = SyntheticWorkload(
        SyntheticConfig(seed=2, num_requests=10, trace_block_size=BLOCK, open_chats=4)
    )
    engine = Engine(config(), workload)
    done = engine.run()
    assert (done.state, done.runtime.requests) == ("finished", 10)


def test_run_waits_out_a_very_slow_replay_until_stopped() -> None:
    # speed 1e-12 made the first wait overflow: OverflowError from run()
    workload = SyntheticWorkload(
        SyntheticConfig(seed=2, num_requests=10, trace_block_size=BLOCK, open_chats=4)
    )
    engine = Engine(config(speed=1e-12), workload)
    thread, raised = run_in_thread(engine)
    time.sleep(0.3)
    engine.stop(timeout=TIMEOUT)
    thread.join(TIMEOUT)
    assert not thread.is_alive() and raised == []
    assert engine.state == "stopped"


class Commands(EngineObserver):
    def __init__(self) -> None:
        self.applied: list[str] = []

    def command_applied(self, result: CommandResult) -> None:
        self.applied.append(result.kind)


def test_a_pause_or_resume_that_changes_nothing_is_not_recorded() -> None:
    # a retried pause moved the dashboard's pause marker, and a resume of a
    # running engine drew a resume marker (as a same-policy switch does not)
    seen = Commands()
    engine = Engine(config(), endless().workload, [seen])
    engine.start()
    try:
        wait_for(engine, lambda s: s.step >= 2)
        idle = engine.resume().result(timeout=TIMEOUT)
        assert idle.changed_nothing and idle.detail == {"from": "running", "to": "running"}
        first = engine.pause().result(timeout=TIMEOUT)
        assert not first.changed_nothing and first.detail == {"from": "running", "to": "paused"}
        again = engine.pause().result(timeout=TIMEOUT)
        assert again.changed_nothing and engine.state == "paused"
        assert engine.snapshot().commands["pause"].timestamp == first.timestamp
        assert "resume" not in engine.snapshot().commands
        engine.resume().result(timeout=TIMEOUT)
        assert seen.applied == ["pause", "resume"]
    finally:
        engine.stop(timeout=TIMEOUT)


# --------------------------------------------------------------------------- lifecycle misuse
# (each found by an audit of the runtime)


class _DeviceLost(InMemoryOffloadingHandler):
    """Fails every poll once a job is in flight, as a lost device would."""

    def get_finished(self) -> list[tuple[int, bool]]:
        if self.num_in_flight:
            raise RuntimeError("device lost")
        return super().get_finished()


def test_a_loop_that_crashes_with_jobs_in_flight_stops_and_fails_commands() -> None:
    # the drain at the end raised again: the engine said "running" for ever
    # and a pause() future never resolved
    c = config()
    handler = _DeviceLost(
        block_size_factor=c.block_factor,
        num_gpu_blocks=c.num_gpu_blocks,
        num_cpu_blocks=c.num_cpu_blocks,
        strict=False,
        delay_polls=3,
    )
    engine = Engine(c, endless_workload(), handler=handler)
    engine.start()
    wait_for(engine, lambda s: s.state == "stopped")
    with pytest.raises(EngineStoppedError):
        engine.pause().result(timeout=TIMEOUT)
    assert engine.stop(timeout=TIMEOUT).state == "stopped"


def test_two_threads_starting_an_engine_start_one_loop() -> None:
    engine = endless()
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        try:
            engine.start()
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    try:
        assert len(errors) == 7 and all("already started" in str(e) for e in errors)
        wait_for(engine, lambda s: s.step >= 5)
    finally:
        assert engine.stop(timeout=TIMEOUT).state == "stopped"


def test_a_stopped_engine_neither_starts_nor_steps() -> None:
    engine = endless()
    engine.stop(timeout=TIMEOUT)
    with pytest.raises(EngineStoppedError, match=r"has stopped: start\(\) refused"):
        engine.start()
    with pytest.raises(EngineStoppedError, match=r"has stopped: step\(\) refused"):
        engine.step()
    assert engine.snapshot().step == 0


def test_step_by_hand_is_refused_while_the_thread_drives(engine: Engine) -> None:
    engine.start()
    with pytest.raises(
        RuntimeError,
        match=r"runs in its own thread \(start\(\)\); use stop\(\) to end it: step\(\) refused",
    ):
        engine.step()


def test_an_observer_can_stop_a_started_engine() -> None:
    # stop() joined its own thread: RuntimeError('cannot join current thread')
    stopped: list[EngineSnapshot] = []

    class StopAtThree(EngineObserver):
        def step_finished(self, step: int, start_ns: int, end_ns: int, requests: int) -> None:
            if step == 3:
                stopped.append(engine.stop())

    engine = Engine(config(), endless_workload(), [StopAtThree()])
    engine.start()
    wait_for(engine, lambda s: s.state == "stopped")
    assert len(stopped) == 1 and engine.snapshot().step == 3


@pytest.mark.parametrize("max_steps", [0, -3, 2.5, "2", True])
def test_run_refuses_a_step_count_that_is_not_one(max_steps: object) -> None:
    engine = endless()
    with pytest.raises(ConfigError, match="max_steps must be None or an int >= 1"):
        engine.run(max_steps=max_steps)  # type: ignore[arg-type]
    assert engine.state == "created"


def test_a_step_by_hand_excludes_the_other_drivers_and_stop_waits_for_it() -> None:
    # step() checked the others but took nothing: start() or run() on another
    # thread ran a second step over the same queues, and stop() ended the
    # engine in the middle of the step (a review found it)
    inside, release = threading.Event(), threading.Event()

    class Holds(EngineObserver):
        def step_started(self, step: int, start_ns: int) -> None:
            inside.set()
            release.wait(TIMEOUT)

    engine = Engine(config(), endless_workload(), [Holds()])
    stepped: list[bool] = []
    hand = threading.Thread(target=lambda: stepped.append(engine.step()))
    hand.start()
    assert inside.wait(TIMEOUT)
    try:
        with pytest.raises(RuntimeError, match=r"step\(\) elsewhere\): start\(\) refused"):
            engine.start()
        with pytest.raises(RuntimeError, match=r"step\(\) elsewhere\): run\(\) refused"):
            engine.run(max_steps=1)
        stopper = threading.Thread(target=engine.stop)
        stopper.start()
        stopper.join(0.3)
        assert stopper.is_alive() and engine.state != "stopped"  # it waits for the step
    finally:
        release.set()
    hand.join(TIMEOUT)
    stopper.join(TIMEOUT)
    assert stepped == [True] and engine.state == "stopped" and engine.snapshot().step == 1


def test_stop_while_start_is_starting_the_thread_joins_it() -> None:
    # stop() read the thread start() had made but not started yet:
    # "cannot join thread before it is started" (a review found it)
    engine = endless()
    publishing, go_on = threading.Event(), threading.Event()
    publish = engine._publish

    def slow_publish() -> None:
        if threading.current_thread().name == "starter" and not publishing.is_set():
            publishing.set()
            go_on.wait(TIMEOUT)
        publish()

    engine._publish = slow_publish  # type: ignore[method-assign]
    starter = threading.Thread(target=engine.start, name="starter")
    starter.start()
    assert publishing.wait(TIMEOUT)
    stopped: list[EngineSnapshot] = []
    stopper = threading.Thread(target=lambda: stopped.append(engine.stop(timeout=TIMEOUT)))
    stopper.start()
    go_on.set()
    starter.join(TIMEOUT)
    stopper.join(TIMEOUT)
    assert [s.state for s in stopped] == ["stopped"]


def test_start_while_another_thread_stops_says_it_is_stopping() -> None:
    # it said "already running (in run())" (a review found it)
    engine = endless()
    draining, go_on = threading.Event(), threading.Event()
    drain = engine._jobs.drain

    def slow_drain() -> None:
        draining.set()
        go_on.wait(TIMEOUT)
        drain()

    engine._jobs.drain = slow_drain  # type: ignore[method-assign]
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    assert draining.wait(TIMEOUT)
    try:
        with pytest.raises(EngineStoppedError, match=r"stopping: start\(\) refused"):
            engine.start()
        with pytest.raises(EngineStoppedError, match=r"stopping: run\(\) refused"):
            engine.run(max_steps=1)
    finally:
        go_on.set()
    stopper.join(TIMEOUT)
    assert engine.state == "stopped"
