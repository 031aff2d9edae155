"""`kvoffload serve` keeps its engine thread and the rest of the process on
separate CPUs (``--pin-threads``, the default) and leaves them alone with
``--no-pin-threads``: read from Linux /proc of a real serve process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from served import served

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="needs Linux and 2+ CPUs to pin threads to",
    ),
]


def threads(pid: int) -> dict[int, tuple[frozenset[int], float]]:
    """tid -> (the CPUs it may run on, its CPU seconds so far)"""
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out[tid] = (frozenset(os.sched_getaffinity(tid)), cpu)
    return out


def test_the_engine_thread_gets_a_cpu_of_its_own() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    engine_cpu = max(cpus)
    with served("--speed", "0") as s:  # a busy engine: the busiest thread now
        before = threads(s.proc.pid)
        time.sleep(1.0)
        state = threads(s.proc.pid)
    engine = max(before, key=lambda tid: state[tid][1] - before[tid][1])
    assert state[engine][0] == {engine_cpu}
    others = {tid: allowed for tid, (allowed, _) in state.items() if tid != engine}
    assert others and all(allowed == cpus - {engine_cpu} for allowed in others.values())


def test_no_pin_threads_leaves_every_thread_on_every_cpu() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    with served("--no-pin-threads") as s:
        state = threads(s.proc.pid)
    assert len(state) >= 2
    assert all(allowed == cpus for allowed, _ in state.values())
