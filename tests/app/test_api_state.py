"""The renderings the service reuses between engine snapshots."""

from __future__ import annotations

import dataclasses
import time

from app.state import MetricsCache, SnapshotCache
from kvoffload.event_log import EventLog
from kvoffload.runtime import EngineSnapshot
from kvoffload.runtime.commands import CommandResult
from kvoffload.runtime.snapshot import RuntimeStats
from kvoffload.stats import ManagerCounters, ManagerStats


def snapshot(step: int = 1, version: int = 1, state: str = "running") -> EngineSnapshot:
    counters = ManagerCounters(0, 0, 0, 0, 0, 0, 0, {}, 0, {}, {}, 0)
    manager = ManagerStats("lru", "CPU", 64, 8, 0, 8, 0, 0, {"lru": 0}, {}, counters, None)
    return EngineSnapshot(state, step, version, "w", manager, RuntimeStats(), time.time())  # type: ignore[arg-type]


def test_snapshot_cache_serves_only_the_same_view() -> None:
    cache = SnapshotCache()
    a = snapshot(1)
    assert cache.get((a, None)) is None
    cache.put((a, None), b"a")
    assert cache.get((a, None)) == b"a"
    assert cache.get((dataclasses.replace(a), None)) is None  # equal, but a later publication


def test_caches_show_a_drain_of_the_same_snapshot_at_once() -> None:
    # issue 18, defect 1: both caches reused a rendering while the snapshot
    # was the same object, so a drain while paused never showed
    log = EventLog(capacity=8)
    for _ in range(5):
        log.append("cleared")
    a = snapshot(1, state="paused")
    before = (a, log.stats())
    cache, metrics = SnapshotCache(), MetricsCache(max_age=60.0)
    cache.put(before, b"a")
    metrics.put(before, b"a", 0)
    assert cache.get((a, log.stats())) == b"a" and metrics.get((a, log.stats()), 0) == b"a"
    log.drain(limit=2)
    after = (a, log.stats())
    assert cache.get(after) is None
    assert metrics.get(after, 0) is None
    metrics.put(after, b"b", 0)
    log.read(after_seq=1)  # a reader's miss is a counter: shown within max_age
    assert metrics.get((a, log.stats()), 0) == b"b"


def test_metrics_cache_bounds_age_and_shows_discrete_changes_at_once() -> None:
    cache = MetricsCache(max_age=60.0)
    a = snapshot(1)
    cache.put((a, None), b"a", 0)
    assert cache.get((snapshot(2), None), 0) == b"a"  # counters moved on, young enough
    assert cache.get((snapshot(2, version=2), None), 0) is None  # policy switched
    assert cache.get((snapshot(2, state="paused"), None), 0) is None  # paused
    # a reset changes neither: it was shown up to max_age late (audit)
    reset = CommandResult("reset", 1, "lru", 1, {"cpu_blocks_evicted": "8"}, time.time())
    after_reset = dataclasses.replace(snapshot(2), commands={"reset": reset})
    assert cache.get((after_reset, None), 0) is None
    old = MetricsCache(max_age=0.0)
    old.put((a, None), b"a", 0)
    assert old.get((a, None), 0) == b"a"
    assert old.get((snapshot(2), None), 0) is None


def test_metrics_cache_renders_again_after_an_api_request_however_still_the_view() -> None:
    # the API's own counters are on the same registry: an idle engine's
    # unchanged snapshot must not freeze them (old: reused while the view was
    # the same object, for ever)
    old = MetricsCache(max_age=0.0)
    a = snapshot(1, state="paused")
    old.put((a, None), b"a", 5)
    assert old.get((a, None), 5) == b"a"
    assert old.get((a, None), 6) is None
    young = MetricsCache(max_age=60.0)
    young.put((a, None), b"a", 5)
    assert young.get((a, None), 6) == b"a"  # within max_age, as every counter
