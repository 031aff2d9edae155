"""The engine hints its waiting queue to the manager: every request that has
arrived and is not served yet is in the manager's hint window, in queue order,
with the offloaded blocks it will use; a request leaves the window right before
it is served; switches and resets keep the window."""

from __future__ import annotations

import itertools
import time

import pytest
from test_engine import BLOCK, small_config, synthetic  # the engine tests' tiny model

from kvoffload.policies import available_policies
from kvoffload.runtime.engine import ADMIT_PER_STEP, Engine
from kvoffload.runtime.snapshot import EngineSnapshot
from kvoffload.runtime.trace import TraceWorkload
from kvoffload.runtime.workloads import Request, engine_block_hashes

FACTOR = 4  # offloaded block of 64 tokens / GPU block of 16


def offloaded(r: Request, num_gpu_blocks: int) -> list[object]:
    """The offloaded hashes ``r`` uses, worked out here from the workload's
    block ids (the engine cuts a prompt to half its GPU cache)."""
    gpu = engine_block_hashes(
        r.block_ids, trace_block_size=BLOCK, engine_block_size=16, num_tokens=r.input_length
    )
    gpu = gpu[: max(FACTOR, (num_gpu_blocks // 2) // FACTOR * FACTOR)]
    return [gpu[(j + 1) * FACTOR - 1] for j in range(len(gpu) // FACTOR)]


def assert_window_is_the_queue(
    engine: Engine, snap: EngineSnapshot, requests: list[Request], waiting: int
) -> None:
    served = snap.runtime.requests
    queued = requests[served : served + waiting]
    uses = [offloaded(r, engine.config.num_gpu_blocks) for r in queued]
    window = snap.manager.window
    assert window.requests == len(queued)
    assert window.uses == sum(map(len, uses))
    assert window.blocks == len({h for u in uses for h in u})
    # every hash the queue will use is hinted, and the next request's come first
    table = engine.manager.table
    if uses and uses[0]:
        assert -1 not in table.next_uses(uses[0])
        assert max(table.next_uses(uses[0])) < min(
            (k for u in uses[1:] for k in table.next_uses(u) if u and u[0] not in uses[0]),
            default=2**62,
        )


@pytest.mark.parametrize("waiting", [4, 16])
def test_the_hint_window_is_the_waiting_queue_after_every_step(waiting: int) -> None:
    requests = list(synthetic(num_requests=120))
    engine = Engine(small_config(max_waiting_requests=waiting), synthetic(num_requests=120))
    steps = 0
    while engine.run(max_steps=1).step > steps:
        steps += 1
        snap = engine.snapshot()
        left = len(requests) - snap.runtime.requests
        assert_window_is_the_queue(engine, snap, requests, min(waiting, left))
    snap = engine.snapshot()
    assert snap.runtime.requests == len(requests)
    assert snap.manager.window.requests == snap.manager.window.uses == 0
    assert snap.manager.window.blocks == 0


def test_switches_and_resets_keep_the_window() -> None:
    requests = list(synthetic(num_requests=200))
    engine = Engine(small_config(max_waiting_requests=8), synthetic(num_requests=200))
    engine.run(max_steps=2)
    for policy in itertools.islice(itertools.cycle(available_policies()), 12):
        engine.switch_policy(policy)
        engine.reset()
        snap = engine.run(max_steps=1)  # both commands apply before the step
        assert snap.manager.policy == policy
        assert snap.commands["reset"].applied_at_step == snap.step - 1
        assert_window_is_the_queue(engine, snap, requests, 8)


def test_a_long_queue_fills_a_bounded_number_of_requests_at_a_time() -> None:
    # found by an audit: at full speed the whole queue joined before the
    # first step (--max-waiting-requests 100000000: gigabytes, and commands
    # and a stop waited for ever); now at most ADMIT_PER_STEP join before a
    # step and as many after it
    requests = list(synthetic(num_requests=3000))
    engine = Engine(small_config(max_waiting_requests=1000), synthetic(num_requests=3000))
    sizes = [engine.run(max_steps=1).manager.window.requests for _ in range(3)]
    assert sizes == [2 * ADMIT_PER_STEP - 4, 1000, 1000]
    assert_window_is_the_queue(engine, engine.snapshot(), requests, 1000)


def test_a_pause_stops_the_arrivals_and_a_resume_brings_no_backlog() -> None:
    # found by an audit: the workload's clock ran on through a pause, and a
    # resume served every request "due" meanwhile in one burst (300 in 0.5 s)
    requests = [Request(i, 0.05 * i, (i % 7, 1000 + i), 2 * BLOCK, 1) for i in range(4000)]
    workload = TraceWorkload(requests, name="every 50 ms", trace_block_size=BLOCK)
    engine = Engine(small_config(speed=1.0, max_waiting_requests=8), workload)
    engine.start()
    try:
        time.sleep(0.3)
        engine.pause().result(timeout=30)
        before = engine.snapshot().runtime.requests
        time.sleep(2.0)  # 40 requests of trace time
        assert engine.snapshot().runtime.requests == before
        engine.resume().result(timeout=30)
        time.sleep(0.25)
        after = engine.snapshot().runtime.requests
    finally:
        engine.stop()
    # at most the 8 waiting at the pause, and 20 a second after the resume
    # (an upper bound: a slow machine only serves fewer)
    assert after - before <= 20
