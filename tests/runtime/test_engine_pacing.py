"""Engine pacing (``EngineConfig.speed``): no request is served before it is due.

Only lower bounds are asserted (a request may be late on a busy machine, never
early), so the tests do not depend on how fast the machine is. The workload is
the first 29 requests of the conversation trace: arrivals at 0, 3 and 5.999 s,
replayed at 20x, so the last group is due 0.3 s after the first request.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.observer import EngineObserver, RequestRecord
from kvoffload.runtime.trace import TraceWorkload, load_mooncake_trace

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
SPEED = 20.0
WAIT_S = 30.0


def trace_slice() -> TraceWorkload:
    trace = load_mooncake_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=29)
    assert trace.span_seconds / SPEED > 0.29
    return trace


def config() -> EngineConfig:
    return EngineConfig(
        gpu_block_size=128,
        offloaded_block_size=512,
        # requests keep 8 GPU blocks: serving the slice takes far less than 0.3 s
        num_gpu_blocks=16,
        num_cpu_blocks=64,
        num_layers=1,
        num_kv_heads=1,
        head_size=8,
        max_requests_per_step=4,
        speed=SPEED,
        device="cpu",
    )


class IssueTimes(EngineObserver):
    """When each request was served (``time.monotonic``, the pacing clock)."""

    def __init__(self) -> None:
        self.served: list[tuple[int, int, float]] = []  # (request id, step, time)

    def request_finished(self, record: RequestRecord) -> None:
        self.served.append((record.request_id, record.step, time.monotonic()))


def check_not_early(trace: TraceWorkload, times: IssueTimes, t0: float) -> None:
    arrival = {r.request_id: r.arrival_time for r in trace}
    first = trace.requests[0].arrival_time
    ids = [rid for rid, _, _ in times.served]
    assert ids == [r.request_id for r in trace]  # every request, in arrival order
    steps = [step for _, step, _ in times.served]
    assert steps == sorted(steps)
    for rid, _, served_at in times.served:
        due = (arrival[rid] - first) / SPEED
        # t0 is taken before the engine anchors its clock, so this is a lower bound
        assert served_at - t0 >= due, (rid, served_at - t0, due)


def test_engine_paced_thread_serves_no_request_before_it_is_due() -> None:
    trace = trace_slice()
    times = IssueTimes()
    engine = Engine(config(), trace, [times])
    t0 = time.monotonic()
    engine.start()
    deadline = time.monotonic() + WAIT_S
    while engine.snapshot().state != "finished" and time.monotonic() < deadline:
        time.sleep(0.01)
    final = engine.stop()
    assert final.runtime.requests == len(trace)
    assert time.monotonic() - t0 >= trace.span_seconds / SPEED
    check_not_early(trace, times, t0)


def test_engine_paced_run_waits_for_due_requests_on_the_calling_thread() -> None:
    trace = trace_slice()
    times = IssueTimes()
    engine = Engine(config(), trace, [times])
    t0 = time.monotonic()
    snap = engine.run()
    assert snap.runtime.requests == len(trace)
    assert time.monotonic() - t0 >= trace.span_seconds / SPEED
    check_not_early(trace, times, t0)


def test_engine_unpaced_run_does_not_wait() -> None:
    trace = trace_slice()
    times = IssueTimes()
    cfg = config()
    engine = Engine(dataclasses.replace(cfg, speed=None), trace, [times])
    snap = engine.run()
    assert snap.runtime.requests == len(trace)
    # as fast as possible: steps are full batches, not split by arrival groups
    assert snap.step == -(-len(trace) // cfg.max_requests_per_step)
