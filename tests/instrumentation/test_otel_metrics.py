"""The catalogue over OTLP: the bridge reports exactly what /metrics reports."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry

from kvoffload.instrumentation import METRICS
from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge
from kvoffload.instrumentation.prometheus import KVOffloadCollector, PrometheusObserver

from .conftest import make_manager, store


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


@pytest.mark.parametrize("policy", ["arc", "kvarc"])
def test_bridge_reports_the_registry_values(policy: str) -> None:
    manager = make_manager(policy, capacity=8)
    registry = CollectorRegistry()
    KVOffloadCollector(manager.stats, registry=registry)
    PrometheusObserver(registry=registry)
    store(manager, range(8))
    store(manager, range(8, 12))  # 4 more into 8 blocks: evictions from T1
    manager.lookup([b"x"])
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    bridge = OTelMetricsBridge(provider, registry)
    points = _points(reader)

    # every catalogue entry has an instrument
    assert len(bridge.instruments) == sum(2 if m.type == "histogram" else 1 for m in METRICS)
    stored = {p.attributes["outcome"]: p.value for p in points["kvoffload_store_blocks"]}
    assert (
        stored["stored"]
        == registry.get_sample_value("kvoffload_store_blocks_total", {"outcome": "stored"})
        == 12
    )
    evicted = {p.attributes["list"]: p.value for p in points["kvoffload_evictions"]}
    assert evicted["t1"] == 4 and sum(evicted.values()) == 4
    arc = {p.attributes["list"]: p.value for p in points["kvoffload_arc_list_blocks"]}
    assert arc == {"t1": 8, "t2": 0, "b1": 4, "b2": 0}
    (lookups,) = points["kvoffload_lookups"]
    assert lookups.value == 1
    # histograms travel as their count and sum
    assert "kvoffload_transfer_duration_seconds_count" in points
    # units where the name says one (once none at all)
    data = reader.get_metrics_data()
    assert data is not None
    units = {
        m.name: m.unit
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert units["kvoffload_transfer_bytes"] == "By"
    assert units["kvoffload_transfer_duration_seconds_sum"] == ""  # "_sum_seconds" otherwise
    provider.shutdown()


def test_bridge_reads_the_registry_once_per_export() -> None:
    calls = 0
    registry = CollectorRegistry()
    manager = make_manager()

    def snapshot() -> Any:
        nonlocal calls
        calls += 1
        return manager.stats()

    KVOffloadCollector(snapshot, registry=registry)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    OTelMetricsBridge(provider, registry)
    before = calls
    reader.get_metrics_data()
    assert calls == before + 1  # ~40 instruments, one collection
    reader.get_metrics_data()
    assert calls == before + 2
    provider.shutdown()


def test_each_export_reports_the_values_of_its_own_moment() -> None:
    # issue 18: the bridge reused a read for a second, so the export at
    # shutdown could report a running engine that had stopped
    manager = make_manager(capacity=8)
    registry = CollectorRegistry()
    KVOffloadCollector(manager.stats, registry=registry)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    OTelMetricsBridge(provider, registry)
    for n in range(1, 4):
        manager.lookup([b"x"])
        (lookups,) = _points(reader)["kvoffload_lookups"]
        assert lookups.value == n
    provider.shutdown()
