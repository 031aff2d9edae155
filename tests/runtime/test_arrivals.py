"""Arrivals and the waiting queue: requests join when due, at most
``capacity`` wait, they leave oldest first, and the hooks see both in order."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvoffload.errors import ConfigError
from kvoffload.runtime.arrivals import Arrivals, WaitingQueue
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.workloads import Request, Workload


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Listed(Workload):
    trace_block_size = 16

    def __init__(self, *times: float) -> None:
        self.requests = [Request(i, t, (i,), 16, 1) for i, t in enumerate(times)]

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def describe(self) -> str:
        return "listed"


def _queue(
    *times: float, speed: float | None, capacity: int, clock: FakeClock
) -> tuple[WaitingQueue, list[str]]:
    seen: list[str] = []
    queue = WaitingQueue(
        Arrivals(Listed(*times), speed, clock=clock),
        capacity,
        on_arrival=lambda r: seen.append(f"+{r.request_id}"),
        on_departure=lambda r: seen.append(f"-{r.request_id}"),
    )
    return queue, seen


def test_at_full_speed_the_queue_holds_the_next_capacity_requests() -> None:
    queue, seen = _queue(0, 5, 9, 60, 61, speed=None, capacity=3, clock=FakeClock())
    assert queue.admit() == 3
    assert [r.request_id for r in queue] == [0, 1, 2]
    assert queue.take() is not None and queue.admit() == 1
    assert [r.request_id for r in queue] == [1, 2, 3]
    while queue.take() is not None:
        queue.admit()
    assert queue.exhausted()
    assert seen == ["+0", "+1", "+2", "-0", "+3", "-1", "+4", "-2", "-3", "-4"]


def test_paced_requests_join_only_once_due() -> None:
    clock = FakeClock()
    queue, _ = _queue(10, 11, 15, speed=2.0, capacity=8, clock=clock)
    assert queue.admit() == 1  # the first anchors the clock: due at once
    assert queue.take() is not None and queue.due_in() == 0.5
    assert queue.admit() == 0
    clock.now += 3.0  # both others are due now (0.5 s and 2.5 s after the first)
    assert queue.admit() == 2 and queue.due_in() == 0.0


def test_a_step_by_hand_takes_the_next_request_before_it_is_due() -> None:
    clock = FakeClock()
    queue, _ = _queue(0, 100, speed=1.0, capacity=4, clock=clock)
    assert queue.admit() == 1 and queue.take() is not None
    assert queue.admit() == 0 and queue.admit(at_least_one=True) == 1
    assert queue.admit(at_least_one=True) == 0  # not empty: only due ones


def test_admit_takes_at_most_its_limit() -> None:
    queue, _ = _queue(*range(10), speed=None, capacity=8, clock=FakeClock())
    assert queue.admit(limit=3) == 3 and len(queue) == 3
    assert queue.admit(limit=100) == 5 and len(queue) == 8  # then the capacity bounds it
    assert queue.take() is not None and queue.admit(limit=0) == 0


def test_a_paused_clock_lets_nothing_arrive_and_resumes_where_it_stopped() -> None:
    # found by an audit: the trace's clock ran on through an engine's pause,
    # and the resume served every request due meanwhile in one burst
    clock = FakeClock()
    queue, _ = _queue(0, 1, 2, 10, speed=1.0, capacity=8, clock=clock)
    arrivals = queue.arrivals
    assert queue.admit() == 1 and queue.take() is not None  # anchored at 100
    clock.now += 0.5
    arrivals.pause()
    arrivals.pause()  # again: no change
    clock.now += 5.0
    assert queue.admit() == 0  # 1 and 2 would be due by now
    arrivals.resume()
    assert queue.due_in() == 0.5  # 1 comes 1 s of running clock after 0
    clock.now += 0.5
    assert queue.admit() == 1
    arrivals.resume()  # not paused: no change
    clock.now += 1.0
    assert queue.admit() == 1 and queue.due_in() == 0.0


def test_a_clock_paused_before_the_first_request_starts_at_the_resume() -> None:
    clock = FakeClock()
    queue, _ = _queue(3, 4, speed=1.0, capacity=8, clock=clock)
    queue.arrivals.pause()
    clock.now += 60.0
    assert queue.admit() == 0
    queue.arrivals.resume()
    assert queue.admit() == 1 and queue.take() is not None and queue.due_in() == 1.0


def test_capacity_and_config_bounds() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        WaitingQueue(Arrivals(Listed(0), None), 0)
    with pytest.raises(ConfigError, match=r"max_waiting_requests .* max_requests_per_step"):
        EngineConfig(max_requests_per_step=8, max_waiting_requests=4)
    with pytest.raises(ConfigError, match="max_waiting_requests must be a positive"):
        EngineConfig(max_waiting_requests=0)
    with pytest.raises(ConfigError, match="max_waiting_requests must be at most 100000"):
        EngineConfig(max_waiting_requests=100_001)
    assert EngineConfig(max_waiting_requests=100_000).max_waiting_requests == 100_000
