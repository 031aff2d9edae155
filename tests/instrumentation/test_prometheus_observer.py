"""PrometheusObserver: transfer and step metrics observed as they happen,
checked against hand-made records and against a real engine on CPU tensors."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.instrumentation import (
    METRICS,
    KVOffloadCollector,
    PrometheusObserver,
    config_labels,
)
from kvoffload.instrumentation.prometheus import ApiMetrics
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.observer import TransferRecord

from .test_prometheus_collector import promtool_check

MS = 1_000_000  # ns


def _get(registry: CollectorRegistry, metric: str, /, **labels: str) -> float:
    v = registry.get_sample_value(metric, labels)
    assert v is not None, f"no sample {metric}{labels}"
    return v


def _record(
    job_id: int, direction: str, blocks: int, nbytes: int, ms: float, ok: bool = True
) -> TransferRecord:
    return TransferRecord(
        job_id=job_id,
        direction=direction,  # type: ignore[arg-type]
        blocks=blocks,
        nbytes=nbytes,
        submitted_ns=10 * MS,
        finished_ns=10 * MS + int(ms * MS),
        ok=ok,
    )


def test_observer_series_exist_at_zero(registry: CollectorRegistry) -> None:
    PrometheusObserver(registry=registry)
    for d in ("store", "load"):
        for o in ("ok", "failed"):
            assert _get(registry, "kvoffload_transfer_jobs_total", direction=d, outcome=o) == 0
        assert _get(registry, "kvoffload_transfer_gpu_blocks_total", direction=d) == 0
        assert _get(registry, "kvoffload_transfer_bytes_total", direction=d) == 0
        assert _get(registry, "kvoffload_transfer_duration_seconds_count", direction=d) == 0
        assert _get(registry, "kvoffload_transfer_size_bytes_count", direction=d) == 0
    assert _get(registry, "kvoffload_runtime_step_duration_seconds_count") == 0


def test_observer_counts_transfers_exactly(registry: CollectorRegistry) -> None:
    obs = PrometheusObserver(registry=registry)
    n, k, nbytes = 7, 4, 4 * 65536
    for i in range(n):
        obs.transfer_finished(_record(i, "store", k, nbytes, ms=0.3))
    obs.transfer_finished(_record(100, "load", 2, 8192, ms=2.0))
    obs.transfer_finished(_record(101, "load", 3, 12288, ms=20.0, ok=False))

    assert _get(registry, "kvoffload_transfer_jobs_total", direction="store", outcome="ok") == n
    assert _get(registry, "kvoffload_transfer_gpu_blocks_total", direction="store") == n * k
    assert _get(registry, "kvoffload_transfer_bytes_total", direction="store") == n * nbytes
    assert _get(registry, "kvoffload_transfer_jobs_total", direction="load", outcome="ok") == 1
    assert _get(registry, "kvoffload_transfer_jobs_total", direction="load", outcome="failed") == 1
    # a failed job moved nothing: blocks, bytes and size count successes only
    assert _get(registry, "kvoffload_transfer_gpu_blocks_total", direction="load") == 2
    assert _get(registry, "kvoffload_transfer_bytes_total", direction="load") == 8192
    assert _get(registry, "kvoffload_transfer_size_bytes_count", direction="load") == 1
    # ... but its duration is observed
    assert _get(registry, "kvoffload_transfer_duration_seconds_count", direction="load") == 2


def test_observer_histogram_buckets_are_cumulative_and_inclusive(
    registry: CollectorRegistry,
) -> None:
    obs = PrometheusObserver(registry=registry)
    obs.transfer_finished(_record(1, "store", 1, 4096, ms=0.3))  # size on a bound: le is <=
    obs.transfer_finished(_record(2, "store", 1, 4097, ms=0.05))  # duration on a bound
    obs.transfer_finished(_record(3, "store", 1, 5 * 1024**3, ms=20_000))  # beyond both tops

    def dur(le: str) -> float:
        return _get(
            registry, "kvoffload_transfer_duration_seconds_bucket", direction="store", le=le
        )

    def size(le: str) -> float:
        return _get(registry, "kvoffload_transfer_size_bytes_bucket", direction="store", le=le)

    assert (dur("5e-05"), dur("0.00025"), dur("0.0005"), dur("10.0"), dur("+Inf")) == (
        1,
        1,
        2,
        2,
        3,
    )
    assert (size("4096.0"), size("16384.0"), size("4.294967296e+09"), size("+Inf")) == (1, 2, 2, 3)
    assert _get(registry, "kvoffload_transfer_size_bytes_count", direction="store") == 3
    assert _get(registry, "kvoffload_transfer_size_bytes_sum", direction="store") == (
        4096 + 4097 + 5 * 1024**3
    )
    assert _get(registry, "kvoffload_transfer_duration_seconds_sum", direction="store") == (
        pytest.approx(0.0003 + 0.00005 + 20.0)
    )


def test_observer_times_steps(registry: CollectorRegistry) -> None:
    obs = PrometheusObserver(registry=registry)
    obs.step_finished(1, 0, 2 * MS, requests=3)
    obs.step_finished(2, 0, 200 * MS, requests=3)
    assert _get(registry, "kvoffload_runtime_step_duration_seconds_count") == 2
    assert _get(registry, "kvoffload_runtime_step_duration_seconds_bucket", le="0.0025") == 1
    assert _get(registry, "kvoffload_runtime_step_duration_seconds_sum") == pytest.approx(0.202)


def test_observer_exposition_passes_promtool(registry: CollectorRegistry) -> None:
    obs = PrometheusObserver(registry=registry)
    obs.transfer_finished(_record(1, "load", 2, 8192, ms=1.0))
    obs.step_finished(1, 0, MS, requests=1)
    promtool_check(generate_latest(registry))


# -- with the real engine ---------------------------------------------------


def _engine(registry: CollectorRegistry, **config: object) -> tuple[Engine, PrometheusObserver]:
    obs = PrometheusObserver(registry=registry)
    cfg = EngineConfig(
        num_cpu_blocks=64,
        num_gpu_blocks=64,
        device="cpu",
        **config,  # type: ignore[arg-type]
    )
    engine = Engine(cfg, observers=[obs])
    KVOffloadCollector(engine.snapshot, registry=registry, config_info=config_labels(cfg))
    return engine, obs


def test_observer_counts_real_engine_transfers(registry: CollectorRegistry) -> None:
    engine, _ = _engine(registry, policy="arc")
    snap = engine.run(max_steps=20)
    r = snap.runtime
    assert r.load_jobs > 0 and r.store_jobs > 0 and r.failed_jobs == 0

    def g(metric: str, /, **labels: str) -> float:
        return _get(registry, metric, **labels)

    assert g("kvoffload_transfer_jobs_total", direction="store", outcome="ok") == r.store_jobs
    assert g("kvoffload_transfer_jobs_total", direction="load", outcome="ok") == r.load_jobs
    assert g("kvoffload_transfer_gpu_blocks_total", direction="store") == r.stored_gpu_blocks
    assert g("kvoffload_transfer_gpu_blocks_total", direction="load") == r.loaded_gpu_blocks
    assert g("kvoffload_transfer_bytes_total", direction="store") == r.stored_bytes
    assert g("kvoffload_transfer_bytes_total", direction="load") == r.loaded_bytes
    assert g("kvoffload_transfer_size_bytes_sum", direction="load") == r.loaded_bytes
    assert g("kvoffload_transfer_duration_seconds_count", direction="store") == r.store_jobs
    assert g("kvoffload_transfer_duration_seconds_sum", direction="store") > 0
    assert g("kvoffload_runtime_step_duration_seconds_count") == r.steps == 20
    assert g("kvoffload_runtime_step_duration_seconds_sum") == pytest.approx(
        r.step_seconds_total, rel=1e-6
    )
    # the scrape-time side agrees with the engine snapshot
    assert g("kvoffload_runtime_steps_total") == 20
    assert g("kvoffload_lookup_hit_blocks_total") == snap.manager.counters.hit_blocks
    assert g("kvoffload_runtime_prompt_tokens_total", outcome="cpu_hit") == r.cpu_hit_tokens


def test_observer_counts_failed_engine_jobs(registry: CollectorRegistry) -> None:
    engine, _ = _engine(registry, inject_failure_rate=0.3, seed=3)
    r = engine.run(max_steps=15).runtime
    assert r.failed_jobs > 0
    failed = sum(
        _get(registry, "kvoffload_transfer_jobs_total", direction=d, outcome="failed")
        for d in ("store", "load")
    )
    assert failed == r.failed_jobs
    assert _get(registry, "kvoffload_store_blocks_total", outcome="failed") > 0


def test_engine_exposition_has_every_catalogue_metric_and_passes_promtool(
    registry: CollectorRegistry,
) -> None:
    engine, _ = _engine(registry, policy="arc")
    engine.run(max_steps=20)
    # the admin API's (the service registers it beside the engine's)
    ApiMetrics(registry=registry).record("GET /v1/cache", "200", 0.001)
    text = generate_latest(registry)
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for spec in METRICS:
        fam = families.get(spec.base_name)
        assert fam is not None, f"{spec.name} missing from an ARC engine's exposition"
        assert fam.type == spec.type and fam.documentation == spec.help
        if not spec.info and spec.type != "histogram":
            for s in fam.samples:
                assert set(s.labels) <= set(spec.labels), (spec.name, s.labels)
    promtool_check(text)


def test_engine_policy_switch_moves_the_series(registry: CollectorRegistry) -> None:
    engine, _ = _engine(registry, policy="arc")
    engine.run(max_steps=10)
    t1_before = _get(registry, "kvoffload_evictions_total", list="t1")
    result = engine.switch_policy("lru", expected_version=1)
    engine.run(max_steps=10)
    assert result.result(timeout=5).policy_version == 2
    assert _get(registry, "kvoffload_policy_version") == 2
    assert _get(registry, "kvoffload_policy_info", policy="lru") == 1
    assert registry.get_sample_value("kvoffload_policy_info", {"policy": "arc"}) is None
    assert registry.get_sample_value("kvoffload_arc_list_blocks", {"list": "t1"}) is None
    assert _get(registry, "kvoffload_evictions_total", list="t1") == t1_before
    assert _get(registry, "kvoffload_policy_list_blocks", policy="lru", list="lru") > 0
