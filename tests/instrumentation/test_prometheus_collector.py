"""KVOffloadCollector over a real PolicyOffloadingManager: every counter moves
exactly as the calls that drove it, gauges mirror the manager, series follow
policy switches, and the exposition passes ``promtool check metrics``."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import PolicyOffloadingManager
from kvoffload._version import __version__
from kvoffload.errors import ConfigError
from kvoffload.instrumentation import METRICS, KVOffloadCollector, config_labels
from kvoffload.policies import available_policies
from kvoffload.runtime.snapshot import EngineSnapshot, RuntimeStats
from kvoffload.table import IMPLEMENTATION

from .conftest import BLOCK_SIZE, bhs, make_manager, store


def _collector(
    m: PolicyOffloadingManager, registry: CollectorRegistry, **kw: object
) -> KVOffloadCollector:
    return KVOffloadCollector(m.stats, registry=registry, **kw)  # type: ignore[arg-type]


def _value(registry: CollectorRegistry) -> Callable[..., float]:
    def value(metric: str, /, **labels: str) -> float:
        v = registry.get_sample_value(metric, labels)
        assert v is not None, f"no sample {metric}{labels}"
        return v

    return value


def _names(registry: CollectorRegistry) -> set[str]:
    return {s.name for fam in registry.collect() for s in fam.samples}


def _label_values(registry: CollectorRegistry, name: str, label: str) -> set[str]:
    return {s.labels[label] for fam in registry.collect() for s in fam.samples if s.name == name}


def test_collector_counts_stores_exactly(registry: CollectorRegistry) -> None:
    m = make_manager(capacity=64)
    _collector(m, registry)
    v = _value(registry)
    before = {
        o: v("kvoffload_store_blocks_total", outcome=o) for o in ("stored", "skipped_present")
    }
    n, k = 5, 4
    for i in range(n):
        store(m, range(i * k, (i + 1) * k))
    assert v("kvoffload_store_blocks_total", outcome="stored") - before["stored"] == n * k
    assert v("kvoffload_store_prepared_blocks_total") == n * k
    # storing the same hashes again: all present, nothing prepared
    store(m, range(0, 2 * k))
    assert v("kvoffload_store_blocks_total", outcome="skipped_present") == 2 * k
    assert v("kvoffload_store_prepared_blocks_total") == n * k


def test_collector_counts_lookups_in_blocks_and_tokens(registry: CollectorRegistry) -> None:
    m = make_manager()
    _collector(m, registry)
    v = _value(registry)
    store(m, range(4))
    for _ in range(3):
        assert m.lookup(bhs(range(6))) == 4
    assert v("kvoffload_lookups_total") == 3
    assert v("kvoffload_lookup_blocks_total") == 18
    assert v("kvoffload_lookup_hit_blocks_total") == 12
    assert v("kvoffload_lookup_tokens_total") == 18 * BLOCK_SIZE
    assert v("kvoffload_lookup_hit_tokens_total") == 12 * BLOCK_SIZE


def test_collector_counts_loads_touches_failures_and_rejections(
    registry: CollectorRegistry,
) -> None:
    m = make_manager(capacity=8)
    _collector(m, registry)
    v = _value(registry)
    store(m, range(4))
    m.prepare_load(bhs(range(3)))
    assert v("kvoffload_load_blocks_total") == 3
    assert v("kvoffload_pinned_blocks", medium="CPU") == 3
    m.touch(bhs(range(4)))
    m.touch(bhs([0]))
    assert v("kvoffload_touched_blocks_total") == 5
    out = m.prepare_store(bhs([10, 11]))
    assert out is not None
    assert v("kvoffload_in_flight_blocks", medium="CPU") == 2
    m.complete_store(out.block_hashes_to_store, success=False)
    assert v("kvoffload_store_blocks_total", outcome="failed") == 2
    assert v("kvoffload_in_flight_blocks", medium="CPU") == 0
    # 3 pinned + 1 evictable + 4 free: 6 new blocks cannot fit
    assert m.prepare_store(bhs(range(20, 26))) is None
    assert v("kvoffload_store_rejections_total") == 1
    assert v("kvoffload_store_blocks_total", outcome="rejected_no_room") == 6


def test_collector_capacity_gauges_match_the_manager(registry: CollectorRegistry) -> None:
    m = make_manager(capacity=16)
    _collector(m, registry)
    v = _value(registry)
    store(m, range(5))
    s = m.stats()
    assert v("kvoffload_capacity_blocks", medium="CPU") == s.capacity == 16
    assert v("kvoffload_used_blocks", medium="CPU") == s.used == 5
    assert v("kvoffload_free_blocks", medium="CPU") == s.free == 11


def test_collector_counts_evictions_by_list(registry: CollectorRegistry) -> None:
    m = make_manager(capacity=4)
    _collector(m, registry)
    v = _value(registry)
    assert v("kvoffload_evictions_total", list="lru") == 0  # pre-created
    store(m, range(4))
    store(m, range(4, 7))
    assert v("kvoffload_evictions_total", list="lru") == 3


@pytest.mark.parametrize("policy", ["arc", "kvarc"])
def test_collector_arc_list_gauges_equal_the_manager_lists(
    registry: CollectorRegistry, policy: str
) -> None:
    m = make_manager(policy, capacity=4)
    _collector(m, registry)
    v = _value(registry)
    store(m, range(4))
    m.touch(bhs([0, 1]))  # promote to t2
    store(m, range(4, 6))  # evicts 2 and 3 from t1 into b1
    # a b1 hit grows the target: arc counts it at the touch, kvarc at the store
    m.touch(bhs([2]))
    store(m, [2])
    lists = m.stats().lists
    for name in ("t1", "t2", "b1", "b2"):
        assert v("kvoffload_arc_list_blocks", list=name) == lists[name]
    # resident lists in blocks, ghost lists (hashes of evicted blocks) apart:
    # stacked together they showed more blocks than the tier holds (issue 18)
    blocks, ghosts = "kvoffload_policy_list_blocks", "kvoffload_policy_ghost_entries"
    for names, metric, other in ((("t1", "t2"), blocks, ghosts), (("b1", "b2"), ghosts, blocks)):
        for name in names:
            assert v(metric, policy=policy, list=name) == lists[name]
            assert registry.get_sample_value(other, {"policy": policy, "list": name}) is None
    resident = [h for h in bhs(range(6)) if h in m][:2]
    m.prepare_load(resident)
    m.complete_load(resident)
    assert v("kvoffload_load_completed_blocks_total") == 2
    assert lists["b1"] > 0 and lists["t2"] > 0
    target = m.stats().target_t1_size
    assert target is not None and target > 0
    assert v("kvoffload_arc_target_t1_blocks") == target
    assert v("kvoffload_policy_parameter", policy=policy, name="target_t1_size") == target
    assert v("kvoffload_ghost_hits_total", list="b1") == 1
    assert v("kvoffload_evictions_total", list="t1") == m.stats().counters.evictions["t1"]


def test_collector_series_follow_a_policy_switch(registry: CollectorRegistry) -> None:
    m = make_manager("arc", capacity=4)
    _collector(m, registry)
    v = _value(registry)
    store(m, range(4))
    store(m, range(4, 6))
    m.touch(bhs([0]))  # ghost hit in b1
    evicted_t1 = v("kvoffload_evictions_total", list="t1")
    assert evicted_t1 == 2
    assert v("kvoffload_policy_info", policy="arc") == 1
    assert v("kvoffload_policy_version") == 1

    m.switch_policy("lru")
    store(m, range(10, 12))

    names = _names(registry)
    assert "kvoffload_arc_list_blocks" not in names
    assert "kvoffload_arc_target_t1_blocks" not in names
    assert _label_values(registry, "kvoffload_policy_list_blocks", "policy") == {"lru"}
    assert _label_values(registry, "kvoffload_policy_info", "policy") == {"lru"}
    assert _label_values(registry, "kvoffload_policy_parameter", "policy") == set()
    assert v("kvoffload_policy_version") == 2
    assert v("kvoffload_policy_switches_total") == 1
    # counters keep every list ever seen, monotonic
    assert v("kvoffload_evictions_total", list="t1") == evicted_t1
    assert v("kvoffload_evictions_total", list="t2") == 0
    assert v("kvoffload_evictions_total", list="lru") == 2
    assert v("kvoffload_ghost_hits_total", list="b1") == 1
    assert v("kvoffload_ghost_hits_total", list="b2") == 0

    m.switch_policy("arc")
    assert v("kvoffload_policy_version") == 3
    assert _label_values(registry, "kvoffload_policy_list_blocks", "policy") == {"arc"}
    assert v("kvoffload_arc_list_blocks", list="t1") == 4

    m.switch_policy("kvarc")  # ARC's series stay for the ARC family
    assert _label_values(registry, "kvoffload_policy_list_blocks", "policy") == {"kvarc"}
    assert v("kvoffload_arc_list_blocks", list="t1") == 4
    assert v("kvoffload_arc_target_t1_blocks") == 2  # kvarc starts at half the capacity


def test_collector_keeps_lists_the_snapshot_no_longer_reports(
    registry: CollectorRegistry,
) -> None:
    # A snapshot source whose eviction counters lose a list (e.g. a manager
    # rebuilt by the app) must not make a counter series vanish.
    m = make_manager(capacity=2)
    store(m, range(2))
    store(m, range(2, 4))
    stats = [m.stats()]
    KVOffloadCollector(lambda: stats[0], registry=registry)
    v = _value(registry)
    assert v("kvoffload_evictions_total", list="lru") == 2
    stats[0] = make_manager("arc", capacity=2).stats()
    assert v("kvoffload_evictions_total", list="lru") == 2
    assert v("kvoffload_evictions_total", list="t1") == 0


def test_collector_event_log_metrics(registry: CollectorRegistry) -> None:
    m = make_manager(capacity=64)
    m.event_log = type(m.event_log)(capacity=3)  # type: ignore[misc]
    _collector(m, registry)
    v = _value(registry)
    for i in range(5):
        store(m, [i])
    assert v("kvoffload_events_appended_total") == 5
    assert v("kvoffload_events_last_seq") == 5
    assert v("kvoffload_events_capacity") == 3
    assert v("kvoffload_events_buffered") == 3
    assert v("kvoffload_events_overwritten_total") == 2
    assert v("kvoffload_events_missed_total") == 0  # nobody read
    assert m.event_log is not None
    m.event_log.read(after_seq=1)  # 2 is gone
    assert v("kvoffload_events_missed_total") == 1
    m.take_events()
    assert v("kvoffload_events_drained_total") == 3
    assert v("kvoffload_events_buffered") == 0


def test_collector_reads_the_event_log_live_when_given_it(registry: CollectorRegistry) -> None:
    m = make_manager(capacity=64)
    store(m, range(3))
    published = m.stats()  # a snapshot taken before the drain, as an engine publishes it
    assert m.event_log is not None
    KVOffloadCollector(lambda: published, registry=registry, event_log=m.event_log)
    v = _value(registry)
    m.event_log.drain(limit=1)
    assert v("kvoffload_events_drained_total") == 1
    assert v("kvoffload_events_buffered") == 0
    assert v("kvoffload_store_blocks_total", outcome="stored") == 3  # the rest: the snapshot


def test_collector_without_event_log_omits_event_metrics(registry: CollectorRegistry) -> None:
    from kvoffload import CPUBackend

    m = PolicyOffloadingManager(CPUBackend(BLOCK_SIZE, 4), enable_events=False)
    _collector(m, registry)
    assert not any(n.startswith("kvoffload_events_") for n in _names(registry))


def test_collector_info_metrics(registry: CollectorRegistry) -> None:
    m = make_manager()
    _collector(m, registry, config_info={"policy": "lru", "num_cpu_blocks": 32, "speed": None})
    v = _value(registry)
    build = [
        s for fam in registry.collect() for s in fam.samples if s.name == "kvoffload_build_info"
    ]
    assert len(build) == 1 and build[0].value == 1
    assert build[0].labels["version"] == __version__
    assert build[0].labels["python"]
    assert build[0].labels["block_table"] == IMPLEMENTATION in ("c", "python")
    # None is "none": an empty value would read as no speed label at all
    assert v("kvoffload_config_info", policy="lru", num_cpu_blocks="32", speed="none") == 1


def test_config_labels_flattens_scalar_dataclass_fields() -> None:
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Cfg:
        policy: str = "arc"
        blocks: int = 8
        fast: bool = True
        ratio: float | None = None
        nested: tuple[int, ...] = field(default=(1, 2))

    assert config_labels(Cfg()) == {"policy": "arc", "blocks": 8, "fast": True, "ratio": None}
    with pytest.raises(ConfigError):
        config_labels({"a": 1})


@pytest.mark.parametrize(
    "bad", [{"bad-name": 1}, {"__reserved": 1}, {"1x": 1}, {"nested": {"a": 1}}]
)
def test_collector_rejects_bad_config_info(bad: dict[str, object]) -> None:
    m = make_manager()
    with pytest.raises(ConfigError):
        KVOffloadCollector(m.stats, config_info=bad)  # type: ignore[arg-type]


def test_collector_registers_only_on_the_given_registry(registry: CollectorRegistry) -> None:
    global_names = set(prometheus_client.REGISTRY._names_to_collectors)
    m = make_manager()
    _collector(m, registry)
    assert set(prometheus_client.REGISTRY._names_to_collectors) == global_names
    # a second collector exposing the same names is refused, not silently doubled
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        _collector(m, registry)


def _engine_snapshot(m: PolicyOffloadingManager, state: str = "running") -> EngineSnapshot:
    runtime = RuntimeStats(
        steps=7,
        requests=11,
        prompt_tokens=1050,
        gpu_hit_tokens=100,
        cpu_hit_tokens=300,
        computed_tokens=600,
        truncated_tokens=50,
        verify_failures=0,
    )
    return EngineSnapshot(
        state=state,  # type: ignore[arg-type]
        step=7,
        policy_version=4,
        workload="test",
        manager=m.stats(),
        runtime=runtime,
        timestamp=0.0,
    )


def test_collector_reads_runtime_stats_from_an_engine_snapshot(
    registry: CollectorRegistry,
) -> None:
    m = make_manager()
    state = ["running"]
    KVOffloadCollector(lambda: _engine_snapshot(m, state[0]), registry=registry)
    v = _value(registry)
    assert v("kvoffload_runtime_steps_total") == 7
    assert v("kvoffload_runtime_requests_total") == 11
    assert v("kvoffload_runtime_prompt_tokens_total", outcome="gpu_hit") == 100
    assert v("kvoffload_runtime_prompt_tokens_total", outcome="truncated") == 50
    assert v("kvoffload_runtime_prompt_tokens_total", outcome="cpu_hit") == 300
    assert v("kvoffload_runtime_prompt_tokens_total", outcome="computed") == 600
    assert v("kvoffload_runtime_verify_failures_total") == 0
    assert v("kvoffload_policy_version") == 4
    assert (v("kvoffload_runtime_up"), v("kvoffload_runtime_paused")) == (1, 0)
    state[0] = "paused"
    assert (v("kvoffload_runtime_up"), v("kvoffload_runtime_paused")) == (1, 1)
    # a replay that ended is not an engine that stopped (once 0: the critical
    # KVOffloadEngineStopped alert paged for a healthy, finished replay)
    state[0] = "finished"
    assert (v("kvoffload_runtime_up"), v("kvoffload_runtime_paused")) == (1, 0)
    state[0] = "stopped"
    assert (v("kvoffload_runtime_up"), v("kvoffload_runtime_paused")) == (0, 0)


def test_collector_marks_each_command_with_when_it_took_effect(
    registry: CollectorRegistry,
) -> None:
    # what the dashboard's markers read: one timestamp per command kind, and
    # the last switch's from and to
    from kvoffload.runtime import Engine, EngineConfig

    engine = Engine(EngineConfig(num_cpu_blocks=32, num_gpu_blocks=64, device="cpu"))
    KVOffloadCollector(engine.snapshot, registry=registry)
    stamp = "kvoffload_command_timestamp_seconds"
    assert registry.get_sample_value(stamp, {"command": "switch_policy"}) is None
    assert "kvoffload_policy_switch_info" not in _names(registry)
    before = time.time()
    engine.switch_policy("arc")
    engine.run(max_steps=2)
    first = registry.get_sample_value(stamp, {"command": "switch_policy"})
    assert first is not None and before <= first <= time.time()
    switched = {"previous_policy": "lru", "policy": "arc"}
    assert registry.get_sample_value("kvoffload_policy_switch_info", switched) == 1
    engine.switch_policy("kvarc")
    engine.reset()
    engine.pause()
    engine.run(max_steps=1)
    v = _value(registry)
    assert v(stamp, command="switch_policy") > first
    assert (
        v(stamp, command="switch_policy") <= v(stamp, command="reset") <= v(stamp, command="pause")
    )
    assert v("kvoffload_policy_switch_info", previous_policy="arc", policy="kvarc") == 1
    assert registry.get_sample_value("kvoffload_policy_switch_info", switched) is None
    assert registry.get_sample_value(stamp, {"command": "resume"}) is None


def test_collector_from_manager_stats_has_no_runtime_metrics(registry: CollectorRegistry) -> None:
    _collector(make_manager(), registry)
    assert not any(n.startswith("kvoffload_runtime_") for n in _names(registry))


def test_collector_exposes_catalogue_metrics_with_their_help(registry: CollectorRegistry) -> None:
    m = make_manager("arc")
    KVOffloadCollector(lambda: _engine_snapshot(m), registry=registry)
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for spec in METRICS:
        if spec.source in ("observer", "api"):
            continue
        fam = families.get(spec.base_name)
        assert fam is not None, f"{spec.name} missing"
        assert fam.type == spec.type
        assert fam.documentation == spec.help


def promtool_check(text: bytes) -> None:
    """Run ``promtool check metrics``; fail (never skip) when it is missing."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool not found: install the Debian package 'prometheus' "
            "(apt-get install -y prometheus), as .ci/run does"
        )
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()


@pytest.mark.parametrize("policy", available_policies())
def test_collector_exposition_passes_promtool(registry: CollectorRegistry, policy: str) -> None:
    m = make_manager(policy, capacity=4)
    store(m, range(4))
    store(m, range(4, 8))
    m.touch(bhs([0, 6]))
    KVOffloadCollector(
        lambda: _engine_snapshot(m),
        registry=registry,
        config_info={"policy": policy, "num_cpu_blocks": 4},
    )
    promtool_check(generate_latest(registry))
