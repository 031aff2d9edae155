"""The renderings the service reuses between engine snapshots."""

from __future__ import annotations

import dataclasses
import time

from app.state import MetricsCache, SnapshotCache
from kvoffload.runtime import EngineSnapshot
from kvoffload.runtime.snapshot import RuntimeStats
from kvoffload.stats import ManagerCounters, ManagerStats


def snapshot(step: int = 1, version: int = 1, state: str = "running") -> EngineSnapshot:
    counters = ManagerCounters(0, 0, 0, 0, 0, 0, 0, {}, 0, {}, {}, 0)
    manager = ManagerStats("lru", "CPU", 64, 8, 0, 8, 0, 0, {"lru": 0}, {}, counters, None)
    return EngineSnapshot(state, step, version, "w", manager, RuntimeStats(), time.time())  # type: ignore[arg-type]


def test_snapshot_cache_serves_only_the_same_snapshot() -> None:
    cache = SnapshotCache()
    a = snapshot(1)
    assert cache.get(a) is None
    cache.put(a, b"a")
    assert cache.get(a) == b"a"
    assert cache.get(dataclasses.replace(a)) is None  # equal, but a later publication


def test_metrics_cache_bounds_age_and_shows_discrete_changes_at_once() -> None:
    cache = MetricsCache(max_age=60.0)
    a = snapshot(1)
    cache.put(a, b"a")
    assert cache.get(snapshot(2)) == b"a"  # counters moved on, young enough
    assert cache.get(snapshot(2, version=2)) is None  # policy switched
    assert cache.get(snapshot(2, state="paused")) is None  # paused
    old = MetricsCache(max_age=0.0)
    old.put(a, b"a")
    assert old.get(a) == b"a"
    assert old.get(snapshot(2)) is None
