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


def test_capacity_and_config_bounds() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        WaitingQueue(Arrivals(Listed(0), None), 0)
    with pytest.raises(ConfigError, match=r"max_waiting_requests .* max_requests_per_step"):
        EngineConfig(max_requests_per_step=8, max_waiting_requests=4)
    with pytest.raises(ConfigError, match="max_waiting_requests must be a positive"):
        EngineConfig(max_waiting_requests=0)
