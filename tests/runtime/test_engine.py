"""The engine on the calling thread: live policy switches, failure injection,
data verification, observers and snapshots."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import Any

import pytest
import torch

from kvoffload.errors import ConfigError, PolicyError
from kvoffload.mediums import CPULoadStoreSpec
from kvoffload.policies import available_policies
from kvoffload.runtime.commands import CommandResult, VersionConflictError
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.observer import EngineObserver, RequestRecord, TransferRecord
from kvoffload.runtime.snapshot import EngineSnapshot
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.trace import TraceWorkload
from kvoffload.runtime.workloads import Request, Workload, engine_block_hashes
from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler
from kvoffload.transfer.layout import Layout
from kvoffload.transfer.memory import InMemoryOffloadingHandler
from kvoffload.transfer.worker import TransferSpec

BLOCK = 64  # tokens per offloaded block = the workloads' trace block size


def small_config(**overrides: object) -> EngineConfig:
    """A tiny model: 2 layers, 1 KV head of 8, 16-token GPU blocks."""
    args: dict[str, object] = {
        "gpu_block_size": 16,
        "offloaded_block_size": BLOCK,
        "num_gpu_blocks": 96,
        "num_cpu_blocks": 48,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_size": 8,
        "max_requests_per_step": 4,
    }
    args.update(overrides)
    return EngineConfig(**args)  # type: ignore[arg-type]


def synthetic(num_requests: int = 200, seed: int = 1) -> SyntheticWorkload:
    """Heavy reuse: few open chats and a small document set."""
    return SyntheticWorkload(
        SyntheticConfig(
            seed=seed,
            num_requests=num_requests,
            trace_block_size=BLOCK,
            open_chats=8,
            num_documents=20,
            document_blocks=(2, 8),
            one_off_blocks=(1, 8),
        )
    )


class Recorder(EngineObserver):
    """Records every hook call."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.finished: list[tuple[int, int]] = []  # (step, requests)
        self.transfers: list[TransferRecord] = []
        self.requests: list[RequestRecord] = []
        self.evicted: list[tuple[int, int, str, dict[str, int]]] = []
        self.commands: list[CommandResult] = []
        self.closed = 0

    def step_started(self, step: int, start_ns: int) -> None:
        self.started.append(step)

    def step_finished(self, step: int, start_ns: int, end_ns: int, requests: int) -> None:
        assert end_ns >= start_ns
        self.finished.append((step, requests))

    def transfer_finished(self, record: TransferRecord) -> None:
        self.transfers.append(record)

    def request_finished(self, record: RequestRecord) -> None:
        self.requests.append(record)

    def blocks_evicted(self, step: int, count: int, policy: str, lists: Mapping[str, int]) -> None:
        self.evicted.append((step, count, policy, dict(lists)))

    def command_applied(self, result: CommandResult) -> None:
        self.commands.append(result)

    def close(self) -> None:
        self.closed += 1


class Raising(EngineObserver):
    """An observer whose every hook fails."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args: object) -> None:
        self.calls += 1
        raise RuntimeError("observer bug")

    step_started = step_finished = transfer_finished = request_finished = _fail  # type: ignore[assignment]
    blocks_evicted = command_applied = close = _fail  # type: ignore[assignment]


class CountingWorkload(Workload):
    """Delegates to ``inner`` and counts calls of :meth:`describe`."""

    def __init__(self, inner: Workload) -> None:
        self.inner = inner
        self.trace_block_size = inner.trace_block_size
        self.describe_calls = 0

    def __iter__(self) -> Iterator[Request]:
        return iter(self.inner)

    def describe(self) -> str:
        self.describe_calls += 1
        return self.inner.describe()


# --------------------------------------------------------------------------- helpers


RUNTIME_COUNTERS = (
    "steps",
    "requests",
    "prompt_tokens",
    "gpu_hit_tokens",
    "cpu_hit_tokens",
    "computed_tokens",
    "truncated_tokens",
    "load_jobs",
    "store_jobs",
    "failed_jobs",
    "loaded_gpu_blocks",
    "stored_gpu_blocks",
    "loaded_bytes",
    "stored_bytes",
    "verify_failures",
)


def counters(snap: EngineSnapshot) -> dict[str, int]:
    """Every monotonic counter of a snapshot, flattened."""
    out = {name: getattr(snap.runtime, name) for name in RUNTIME_COUNTERS}
    c = snap.manager.counters
    for field in fields(c):
        if field.type == "int":
            out[f"manager.{field.name}"] = getattr(c, field.name)
    for group in ("store_blocks", "evictions", "ghost_hits"):
        for key, value in getattr(c, group).items():
            out[f"manager.{group}.{key}"] = value
    return out


def assert_monotonic(before: EngineSnapshot, after: EngineSnapshot) -> None:
    old, new = counters(before), counters(after)
    for name, value in old.items():
        assert new.get(name, 0) >= value, name
    assert after.runtime.step_seconds_total >= before.runtime.step_seconds_total


def assert_settled(engine: Engine, snap: EngineSnapshot) -> None:
    """What must hold whenever no job is in flight (after run() returns)."""
    m = snap.manager
    assert m.used + m.free == m.capacity == engine.config.num_cpu_blocks
    assert m.used == len(engine.manager)
    assert (m.pinned, m.in_flight) == (0, 0)
    assert m.counters.load_blocks == m.counters.load_completed_blocks
    rt = snap.runtime
    assert (
        rt.gpu_hit_tokens + rt.cpu_hit_tokens + rt.computed_tokens + rt.truncated_tokens
        == rt.prompt_tokens
    )
    # every GPU block is reusable again
    assert engine.kv.available() == engine.config.num_gpu_blocks


def assert_transfer_accounting(engine: Engine, snap: EngineSnapshot) -> None:
    """Moved blocks, bytes and tokens agree with one another."""
    rt, c = snap.runtime, snap.manager.counters
    k = engine.config.block_factor
    assert rt.loaded_bytes == rt.loaded_gpu_blocks * engine.kv.block_bytes
    assert rt.stored_bytes == rt.stored_gpu_blocks * engine.kv.block_bytes
    # failed loads are recomputed: CPU hit tokens are the blocks that arrived
    assert rt.cpu_hit_tokens == rt.loaded_gpu_blocks * engine.config.gpu_block_size
    # each store job completes all of its blocks, successfully or not
    assert rt.stored_gpu_blocks == c.store_blocks["stored"] * k
    assert c.store_prepared_blocks == c.store_blocks["stored"] + c.store_blocks["failed"]


LAYOUTS: tuple[Layout, ...] = ("kv_first", "blocks_first")


# --------------------------------------------------------------------------- snapshots and config


def test_engine_describes_the_workload_once_not_per_snapshot() -> None:
    # A trace's describe() scans every request: per snapshot it made a replay
    # quadratic in the trace length.
    workload = CountingWorkload(synthetic(num_requests=40))
    engine = Engine(small_config(), workload)
    snap = engine.run()
    assert snap.step >= 10
    assert workload.describe_calls == 1
    assert snap.workload == engine.workload_description == workload.inner.describe()


def test_engine_publishes_the_snapshot_before_resolving_a_command() -> None:
    # A caller that waits for a command and then reads the snapshot (the admin
    # API does) must see the command's effect. Done callbacks run inside
    # set_result, so they see exactly what such a caller could see first.
    engine = Engine(small_config(), synthetic(num_requests=40))
    engine.run(max_steps=5)
    assert engine.snapshot().manager.used > 0
    seen: list[EngineSnapshot] = []
    switch = engine.switch_policy("arc")
    reset = engine.reset()
    for future in (switch, reset):
        future.add_done_callback(lambda _: seen.append(engine.snapshot()))
    engine.run(max_steps=1)
    after_switch, after_reset = seen
    assert (after_switch.manager.policy, after_switch.policy_version) == ("arc", 2)
    assert after_reset.manager.used == 0
    assert after_reset.step == reset.result().applied_at_step == 5


def test_engine_config_rejects_a_gpu_cache_smaller_than_an_offloaded_block() -> None:
    # Used to be accepted, then the first request of a full offloaded block
    # raised ConfigError inside a step (and stopped a background engine).
    with pytest.raises(ConfigError, match="num_gpu_blocks"):
        small_config(num_gpu_blocks=3)  # 4 GPU blocks per offloaded block
    engine = Engine(small_config(num_gpu_blocks=4, num_cpu_blocks=8), synthetic(num_requests=40))
    snap = engine.run()
    assert snap.runtime.requests == 40
    assert snap.runtime.cpu_hit_tokens > 0
    assert_settled(engine, snap)


# --------------------------------------------------------------------------- policy switch


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_switches_policy_mid_run_many_times(layout: Layout) -> None:
    engine = Engine(small_config(kv_layout=layout), synthetic(num_requests=400))
    before = engine.snapshot()
    assert before.policy_version == 1
    switches = 0
    previous = before.manager.policy
    for policy in itertools.cycle(available_policies()):
        future = engine.switch_policy(policy)
        snap = engine.run(max_steps=4)
        result = future.result(timeout=0)  # applied by run() before its first step
        switches += 1
        assert (result.kind, result.policy) == ("switch_policy", policy)
        assert result.applied_at_step == before.step
        assert result.policy_version == snap.policy_version == switches + 1
        assert dict(result.detail) == {"from": previous, "to": policy}
        assert snap.manager.policy == policy
        assert snap.manager.counters.policy_switches == switches
        assert_settled(engine, snap)
        assert_monotonic(before, snap)
        if snap.step == before.step:  # the workload is exhausted
            break
        before, previous = snap, policy
    assert switches > 20
    rt = snap.runtime
    assert rt.requests == 400
    assert rt.verify_failures == 0
    assert rt.failed_jobs == 0
    assert rt.loaded_gpu_blocks > 0
    assert rt.cpu_hit_tokens > 0
    assert sum(snap.manager.counters.evictions.values()) > 0
    assert_transfer_accounting(engine, snap)


def test_engine_switch_to_the_current_policy_changes_nothing() -> None:
    # once it re-made the policy (its lists and ghosts gone) and bumped the
    # version: a retried switch lost what the policy had learned
    engine = Engine(small_config(), synthetic(num_requests=8))
    policy = engine.manager.policy
    future = engine.switch_policy("LRU")
    engine.run(max_steps=1)
    result = future.result(timeout=0)
    assert (result.policy, result.policy_version) == ("lru", 1)
    assert dict(result.detail) == {"from": "lru", "to": "lru"}
    assert engine.manager.policy is policy


def test_engine_rejects_an_unknown_policy_at_once() -> None:
    engine = Engine(small_config(), synthetic(num_requests=8))
    with pytest.raises(PolicyError):
        engine.switch_policy("fifo-ish")
    with pytest.raises(PolicyError):
        Engine(small_config(policy="nope"), synthetic(num_requests=8))


def test_engine_stale_expected_version_fails_the_future() -> None:
    engine = Engine(small_config(), synthetic(num_requests=20))
    first = engine.switch_policy("arc", expected_version=1)
    stale = engine.switch_policy("lru", expected_version=1)
    snap = engine.run(max_steps=1)
    assert first.result(timeout=0).policy_version == 2
    error = stale.exception(timeout=0)
    assert isinstance(error, VersionConflictError)
    assert (error.expected, error.current) == (1, 2)
    assert snap.manager.policy == "arc"


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_injected_failures_keep_accounting_exact(layout: Layout) -> None:
    config = small_config(inject_failure_rate=0.3, seed=7, kv_layout=layout)
    records = Recorder()
    engine = Engine(config, synthetic(num_requests=300), [records])
    snap = engine.run()
    rt, c = snap.runtime, snap.manager.counters
    assert rt.requests == 300
    assert rt.verify_failures == 0  # a failed load is recomputed, never verified
    assert_settled(engine, snap)
    assert_transfer_accounting(engine, snap)
    failed = [t for t in records.transfers if not t.ok]
    failed_loads = [t for t in failed if t.direction == "load"]
    failed_stores = [t for t in failed if t.direction == "store"]
    assert failed_loads and failed_stores
    assert rt.failed_jobs == len(failed)
    assert c.store_blocks["failed"] * config.block_factor == sum(t.blocks for t in failed_stores)
    ok_loads = [t for t in records.transfers if t.ok and t.direction == "load"]
    assert ok_loads  # some loads still succeed
    assert rt.loaded_gpu_blocks == sum(t.blocks for t in ok_loads)
    # issue 18: a request is reported once its load finished, and a failed
    # load's tokens count as computed, so the requests add up to the totals
    # (they used to count failed loads as CPU hits)
    assert len(records.requests) == rt.requests
    outcomes = ("gpu_hit_tokens", "cpu_hit_tokens", "computed_tokens", "truncated_tokens")
    for outcome in ("prompt_tokens", *outcomes):
        assert sum(getattr(r, outcome) for r in records.requests) == getattr(rt, outcome)
    assert all(0 < r.started_ns <= r.finished_ns for r in records.requests)


def in_memory_handler(
    config: EngineConfig,
    cls: type[InMemoryOffloadingHandler] = InMemoryOffloadingHandler,
    **kw: object,
) -> InMemoryOffloadingHandler:
    return cls(
        block_size_factor=config.block_factor,
        num_gpu_blocks=config.num_gpu_blocks,
        num_cpu_blocks=config.num_cpu_blocks,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "handler_kw",
    [
        pytest.param({"refuse_all": True}, id="refused"),
        pytest.param({"failure_rate": 1.0, "strict": False}, id="accepted-then-failed"),
    ],
)
def test_engine_with_a_failing_handler_stores_nothing_and_leaks_nothing(
    handler_kw: dict[str, Any],
) -> None:
    config = small_config()
    handler = in_memory_handler(config, **handler_kw)
    engine = Engine(config, synthetic(num_requests=120), handler=handler)
    snap = engine.run()
    rt, m = snap.runtime, snap.manager
    c = m.counters
    assert rt.requests == 120
    assert rt.store_jobs > 0
    assert rt.failed_jobs == rt.store_jobs  # nothing was ever stored, so nothing loaded
    assert rt.load_jobs == rt.loaded_gpu_blocks == rt.cpu_hit_tokens == 0
    assert c.store_blocks["stored"] == 0
    assert c.store_blocks["failed"] == c.store_prepared_blocks > 0
    assert m.used == 0
    assert handler.num_in_flight == 0
    if handler_kw.get("refuse_all"):
        assert handler.submitted == []
    else:
        assert len(handler.submitted) == rt.store_jobs
    assert rt.verify_failures == 0
    assert_settled(engine, snap)
    assert_transfer_accounting(engine, snap)


def test_engine_some_refused_stores_fail_only_their_blocks() -> None:
    config = small_config()
    # Refuse the 2nd, 4th, 6th... job. Accepted jobs copy nothing (the fake's
    # rows are not the engine's tensors), so the run stays within one step:
    # its stores finish at its end, no lookup can hit, and nothing is loaded.
    handler = in_memory_handler(config, refuse_job_ids=range(2, 2000, 2), strict=False)
    engine = Engine(config, synthetic(num_requests=60), handler=handler)
    snap = engine.run(max_steps=1)
    assert snap.runtime.load_jobs == 0
    assert snap.runtime.store_jobs >= 2
    assert 0 < snap.runtime.failed_jobs < snap.runtime.store_jobs
    c = snap.manager.counters
    assert 0 < c.store_blocks["failed"] < c.store_prepared_blocks
    assert snap.manager.used == c.store_blocks["stored"]
    assert_settled(engine, snap)


class LateFailingLoads(InMemoryOffloadingHandler):
    """Reports every job a few polls late (like a GPU copy stream) and fails
    every load, so failures arrive steps after their requests were served."""

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if isinstance(spec[0], CPULoadStoreSpec):
            self.fail_job(job_id)
        return super().transfer_async(job_id, spec)


def test_a_pause_finishes_the_jobs_in_flight_so_the_paused_engine_is_settled() -> None:
    # issue 18: a pause left jobs in flight (a GPU copy stream reports them
    # later), so a paused engine's counts were not settled: prompt tokens
    # without an outcome, requests not yet reported, blocks in flight
    config = small_config(num_cpu_blocks=96)
    handler = in_memory_handler(config, strict=False, delay_polls=3)
    records = Recorder()
    engine = Engine(config, synthetic(num_requests=200), [records], handler=handler)
    published: list[EngineSnapshot] = []
    records.command_applied = lambda _: published.append(engine.snapshot())  # type: ignore[method-assign]
    while engine.step() and not len(engine._jobs):
        pass
    assert len(engine._jobs) > 0, "the delayed handler leaves jobs in flight after a step"
    engine.pause()
    engine.run()  # applies the pause and returns
    (snap,) = published  # what readers saw once the pause was applied
    assert snap.state == "paused"
    assert_settled(engine, snap)
    assert len(records.requests) == snap.runtime.requests
    assert len(records.transfers) == snap.runtime.load_jobs + snap.runtime.store_jobs


def test_engine_counters_stay_monotonic_when_loads_fail_steps_later() -> None:
    # A failed load turns its CPU-hit tokens into computed ones. Counted at
    # serve time and taken back at failure, cpu_hit_tokens went down between
    # snapshots (a Prometheus counter reset); now it counts arrived blocks.
    config = small_config(num_cpu_blocks=96)
    handler = in_memory_handler(config, LateFailingLoads, strict=False, delay_polls=3)
    engine = Engine(config, synthetic(num_requests=200), handler=handler)
    previous = engine.snapshot()
    in_flight_seen = False
    while engine.step():
        snap = engine.snapshot()
        assert_monotonic(previous, snap)
        rt = snap.runtime
        settled = rt.gpu_hit_tokens + rt.cpu_hit_tokens + rt.computed_tokens + rt.truncated_tokens
        assert settled <= rt.prompt_tokens
        in_flight_seen |= settled < rt.prompt_tokens
        previous = snap
    final = engine.run()  # drains the jobs still in flight
    assert_monotonic(previous, final)
    rt = final.runtime
    assert in_flight_seen
    assert rt.load_jobs > 0
    assert rt.cpu_hit_tokens == rt.loaded_gpu_blocks == 0
    assert rt.failed_jobs == rt.load_jobs
    assert_settled(engine, final)


# --------------------------------------------------------------------------- data integrity


def trace_of(*prompts: tuple[tuple[int, ...], int]) -> TraceWorkload:
    """Requests of (trace ids, prompt tokens), one per second."""
    return TraceWorkload(
        [
            Request(
                request_id=i, arrival_time=float(i), block_ids=ids, input_length=n, output_length=1
            )
            for i, (ids, n) in enumerate(prompts)
        ],
        name="handmade",
        trace_block_size=BLOCK,
    )


# r0 is stored; r1 and r2 push it out of a 24-block GPU cache; r3 loads it back
STORE_EVICT_LOAD = trace_of(
    ((1, 2, 3), 3 * BLOCK),
    ((10, 11, 12), 3 * BLOCK),
    ((20, 21, 22), 3 * BLOCK),
    ((1, 2, 3), 3 * BLOCK),
)


def integrity_engine(layout: Layout, workload: TraceWorkload) -> Engine:
    config = small_config(
        num_gpu_blocks=24, num_cpu_blocks=16, max_requests_per_step=1, kv_layout=layout
    )
    return Engine(config, workload)


def mirror_row(engine: Engine, layer: int, kv_index: int, row: int) -> torch.Tensor:
    """The bytes of one CPU-mirror row (one GPU-sized sub-block) of one layer."""
    handler = engine.worker.handlers[0]
    assert isinstance(handler, CpuGpuOffloadingHandler)
    t = handler.cpu_tensors[layer]
    block = t[kv_index, row] if engine.config.kv_layout == "kv_first" else t[row, kv_index]
    return block.reshape(-1).view(torch.uint8)


def cpu_block_of(engine: Engine, ids: tuple[int, ...], position: int) -> int:
    """The CPU block id that holds the offloaded block at ``position`` of ``ids``."""
    k = engine.config.block_factor
    hashes = engine_block_hashes(ids, trace_block_size=BLOCK, engine_block_size=16)
    status = engine.manager.get_block(hashes[(position + 1) * k - 1])
    assert status is not None
    block_id: int = status.block_id  # type: ignore[attr-defined]
    return block_id


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_loads_verify_clean_after_a_round_trip(layout: Layout) -> None:
    engine = integrity_engine(layout, STORE_EVICT_LOAD)
    snap = engine.run()
    rt = snap.runtime
    assert rt.stored_gpu_blocks == 3 * 3 * 4  # r0..r2: 3 blocks of 4 GPU blocks each
    assert rt.loaded_gpu_blocks == 12  # r3 came back from the CPU tier
    assert rt.cpu_hit_tokens == 3 * BLOCK
    assert rt.verify_failures == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_corrupted_cpu_mirror_is_caught_on_load(layout: Layout) -> None:
    engine = integrity_engine(layout, STORE_EVICT_LOAD)
    engine.run(max_steps=3)  # r0 stored and evicted from the GPU
    handler = engine.worker.handlers[0]
    assert isinstance(handler, CpuGpuOffloadingHandler)
    for t in handler.cpu_tensors:
        t.view(torch.int16).add_(1)  # every word of the mirror changes
    snap = engine.run()
    assert snap.runtime.loaded_gpu_blocks == 12
    assert snap.runtime.verify_failures == 12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("layer", "kv_index", "sub"), [(0, 0, 0), (1, 1, 3), (1, 0, 2)])
def test_engine_one_flipped_byte_in_the_mirror_fails_one_block(
    layout: Layout, layer: int, kv_index: int, sub: int
) -> None:
    engine = integrity_engine(layout, STORE_EVICT_LOAD)
    engine.run(max_steps=3)
    row = cpu_block_of(engine, (1, 2, 3), 1) * engine.config.block_factor + sub
    mirror_row(engine, layer, kv_index, row)[5] ^= 0x01
    snap = engine.run()
    assert snap.runtime.loaded_gpu_blocks == 12
    assert snap.runtime.verify_failures == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_gpu_hit_inside_an_offloaded_block_loads_only_the_rest(layout: Layout) -> None:
    # r3 brings block 1 back and computes half of block 2; r4 then hits 6 GPU
    # blocks and loads the last 2 sub-blocks of CPU block 2 (vLLM defect 7).
    workload = trace_of(
        ((1, 2), 2 * BLOCK),
        ((10, 11, 12), 3 * BLOCK),
        ((20, 21, 22), 3 * BLOCK),
        ((1, 2), 2 * BLOCK - 32),
        ((1, 2), 2 * BLOCK),
    )
    engine = integrity_engine(layout, workload)
    records = Recorder()
    engine.observers = (records,)
    engine.run(max_steps=4)
    # sub-blocks 0 and 1 of block 2 are not loaded: corrupting them is harmless;
    # sub-block 3 is, and must fail verification
    base = cpu_block_of(engine, (1, 2), 1) * engine.config.block_factor
    for sub in (0, 1, 3):
        mirror_row(engine, 0, 1, base + sub)[0] ^= 0x80
    snap = engine.run()
    r4 = records.requests[-1]
    assert (r4.gpu_hit_tokens, r4.cpu_hit_tokens, r4.computed_tokens) == (96, 32, 0)
    r3 = records.requests[-2]
    assert (r3.gpu_hit_tokens, r3.cpu_hit_tokens, r3.computed_tokens) == (0, 64, 32)
    assert snap.runtime.loaded_gpu_blocks == 4 + 2
    assert snap.runtime.verify_failures == 1


# --------------------------------------------------------------------------- observers


def test_engine_calls_every_observer_hook_with_consistent_numbers() -> None:
    records = Recorder()
    engine = Engine(small_config(num_cpu_blocks=24), synthetic(num_requests=150), [records])
    switch = engine.switch_policy("arc")
    reset = engine.reset()
    snap = engine.run()
    assert switch.done() and reset.done()
    rt = snap.runtime
    # one start and one finish per step, in order
    assert records.started == list(range(1, rt.steps + 1))
    assert [s for s, _ in records.finished] == records.started
    assert sum(n for _, n in records.finished) == rt.requests == 150
    # one record per request (one whose load is in flight comes when the load
    # finished); the tokens add up per request and in total
    assert sorted(r.request_id for r in records.requests) == list(range(150))
    for r in records.requests:
        assert (
            r.gpu_hit_tokens + r.cpu_hit_tokens + r.computed_tokens + r.truncated_tokens
            == r.prompt_tokens
        )
    assert sum(r.prompt_tokens for r in records.requests) == rt.prompt_tokens
    assert sum(r.gpu_hit_tokens for r in records.requests) == rt.gpu_hit_tokens
    assert sum(r.cpu_hit_tokens for r in records.requests) == rt.cpu_hit_tokens
    assert sum(r.computed_tokens for r in records.requests) == rt.computed_tokens
    # one record per job, with its bytes
    loads = [t for t in records.transfers if t.direction == "load"]
    stores = [t for t in records.transfers if t.direction == "store"]
    assert (len(loads), len(stores)) == (rt.load_jobs, rt.store_jobs)
    assert loads and stores
    assert len({t.job_id for t in records.transfers}) == len(records.transfers)
    for t in records.transfers:
        assert t.ok
        assert t.blocks > 0
        assert t.nbytes == t.blocks * engine.kv.block_bytes
        assert t.finished_ns >= t.submitted_ns
    assert sum(t.blocks for t in loads) == rt.loaded_gpu_blocks
    assert sum(t.nbytes for t in stores) == rt.stored_bytes
    # evictions: every prepare_store eviction, under the policy of the time
    assert sum(n for _, n, _, _ in records.evicted) == sum(snap.manager.counters.evictions.values())
    assert {p for _, _, p, _ in records.evicted} == {"arc"}
    assert all(1 <= s <= rt.steps for s, _, _, _ in records.evicted)
    # and which lists the victims left
    assert all(n == sum(lists.values()) for _, n, _, lists in records.evicted)
    by_list: dict[str, int] = {}
    for _, _, _, lists in records.evicted:
        for name, k in lists.items():
            by_list[name] = by_list.get(name, 0) + k
    assert by_list == {k: v for k, v in snap.manager.counters.evictions.items() if v}
    # commands, in the order they were queued, before the first step
    assert [(c.kind, c.applied_at_step) for c in records.commands] == [
        ("switch_policy", 0),
        ("reset", 0),
    ]
    assert records.commands[0] == switch.result()
    assert records.closed == 0
    final = engine.stop()
    assert final.state == "stopped"
    assert records.closed == 1


def test_engine_survives_an_observer_that_raises() -> None:
    def run(observers: list[EngineObserver]) -> EngineSnapshot:
        engine = Engine(small_config(), synthetic(num_requests=60), observers)
        engine.switch_policy("arc")
        engine.run()
        return engine.stop()

    raising, records = Raising(), Recorder()
    snap = run([raising, records])
    assert raising.calls > 0
    # the observer after the failing one saw everything
    assert len(records.requests) == snap.runtime.requests == 60
    assert len(records.commands) == 1
    assert records.closed == 1
    # and the run did exactly what it does without observers
    plain = run([])
    assert plain.runtime.requests == snap.runtime.requests
    assert counters(plain) == counters(snap)
    assert snap.state == "stopped"


def test_a_switch_to_the_current_policy_is_not_the_last_switch_anyone_is_told_of() -> None:
    """/metrics' last switch (kvoffload_policy_switch_info, the command
    timestamp) and the observers' policy_switch log once showed "lru -> lru"
    for a PUT that changed nothing, and lost the real last switch."""
    seen: list[CommandResult] = []

    class Watcher(EngineObserver):
        def command_applied(self, result: CommandResult) -> None:
            seen.append(result)

    engine = Engine(small_config(), synthetic(num_requests=8), observers=[Watcher()])
    real = engine.switch_policy("arc")
    again = engine.switch_policy("arc")
    snap = engine.run(max_steps=1)
    assert again.result(timeout=0).changed_nothing and not real.result(timeout=0).changed_nothing
    assert [r.detail["from"] for r in seen] == ["lru"]
    assert snap.commands["switch_policy"] is real.result(timeout=0)


@pytest.mark.parametrize("size", [0, -16, 16.0, True])
def test_engine_refuses_a_workload_block_size_that_is_not_a_count(size: object) -> None:
    # 0 and -16 passed the divisibility check (0 % 16 == 0) and crashed the
    # engine's thread at its first step
    workload = TraceWorkload([], name="odd", trace_block_size=size)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"trace_block_size must be a positive integer \(tokens\), got"
    ):
        Engine(small_config(), workload)


def test_a_cpu_cache_and_tier_that_fit_alone_but_not_together_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each was checked against the memory share alone: both passed, and
    # `kvoffload serve` could be killed for memory instead (found by an audit);
    # on a CUDA device the simulated cache is not in CPU memory
    config = small_config(device="cpu")
    store = Engine(config, synthetic(num_requests=1)).kv
    store_bytes = sum(t.numel() * t.element_size() for t in store.tensors.values())
    mirror_bytes = CpuGpuOffloadingHandler.mirror_bytes(
        store.tensors,
        config.gpu_block_size,
        config.offloaded_block_size,
        config.num_cpu_blocks,
        layouts=config.kv_layout,
    )
    limit = max(store_bytes, mirror_bytes) + 1  # each fits, both do not
    for module in ("engine", "kv_store"):
        monkeypatch.setattr(f"kvoffload.runtime.{module}.default_max_cpu_bytes", lambda: limit)
    monkeypatch.setattr("kvoffload.transfer.cpu_gpu.default_max_cpu_bytes", lambda: limit)
    with pytest.raises(ConfigError, match=r"together need more than .*--num-cpu-blocks"):
        Engine(config, synthetic(num_requests=1))
    monkeypatch.setattr(
        "kvoffload.runtime.engine.default_max_cpu_bytes", lambda: store_bytes + mirror_bytes
    )
    Engine(config, synthetic(num_requests=1))  # exactly the share is enough


def test_a_prompt_longer_than_half_the_gpu_cache_counts_its_tail_as_truncated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # found by an audit: the engine serves the prefix the simulated GPU cache
    # prefills at once (half of it) and dropped the rest from every count (a
    # 23,141-token prompt had gen_ai.usage.input_tokens 4096, and the prompt
    # tokens of a trace's 300 requests were a quarter of the trace's)
    config = small_config()  # 96 GPU blocks of 16 tokens: 48 prefilled at once
    requests = [
        Request(0, 0.0, tuple(range(20)), 20 * BLOCK, 1),  # 80 GPU blocks: 32 cut
        Request(1, 0.0, (100,), BLOCK, 1),  # 4: whole
        Request(2, 0.0, tuple(range(30)), 30 * BLOCK, 1),  # 120: 72 cut
    ]
    recorder = Recorder()
    engine = Engine(
        config, TraceWorkload(requests, name="long", trace_block_size=BLOCK), [recorder]
    )
    with caplog.at_level("WARNING", logger="kvoffload.runtime.scheduling"):
        rt = engine.run().runtime
    cut = {r.request_id: r.truncated_tokens for r in recorder.requests}
    assert cut == {0: 32 * 16, 1: 0, 2: 72 * 16}
    for r in recorder.requests:
        assert r.prompt_tokens == len(requests[r.request_id].block_ids) * BLOCK
        served = r.gpu_hit_tokens + r.cpu_hit_tokens + r.computed_tokens
        assert served + r.truncated_tokens == r.prompt_tokens
    assert rt.truncated_tokens == sum(cut.values())
    assert rt.prompt_tokens == sum(len(r.block_ids) * BLOCK for r in requests)
    (warning,) = caplog.records  # once, at the first such request
    assert "request 0 has 80 full GPU blocks of prompt" in warning.getMessage()
