"""Telemetry for kvoffload: Prometheus metrics and OpenTelemetry traces/logs.

Nothing here is imported by ``import kvoffload``. The catalogue
(:data:`METRICS`) needs only the standard library; the Prometheus pieces need
``prometheus_client`` (extra ``kvoffload[prometheus]``) and the tracing piece
``opentelemetry-api`` (extra ``kvoffload[otel]``); each loads on first access.

Typical wiring (the application owns the registry and the providers)::

    registry = CollectorRegistry()
    metrics = PrometheusObserver(registry=registry)
    tracing = TracingObserver(tracer_provider, logger_provider)
    engine = Engine(config, observers=[metrics, tracing])
    tracing.watch_event_log(engine.event_log)
    KVOffloadCollector(engine.snapshot, registry=registry,
                       config_info=config_labels(engine.config),
                       event_log=engine.event_log)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.instrumentation.catalogue import (
    ALLOWED_LABELS,
    METRICS,
    METRICS_BY_NAME,
    MetricSpec,
    render_markdown_table,
)

if TYPE_CHECKING:
    from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge
    from kvoffload.instrumentation.prometheus import (
        KVOffloadCollector,
        PrometheusObserver,
        config_labels,
    )
    from kvoffload.instrumentation.tracing import TracingObserver

__all__ = [
    "ALLOWED_LABELS",
    "METRICS",
    "METRICS_BY_NAME",
    "KVOffloadCollector",
    "MetricSpec",
    "OTelMetricsBridge",
    "PrometheusObserver",
    "TracingObserver",
    "config_labels",
    "render_markdown_table",
]

_LAZY = {
    "KVOffloadCollector": "kvoffload.instrumentation.prometheus",
    "PrometheusObserver": "kvoffload.instrumentation.prometheus",
    "config_labels": "kvoffload.instrumentation.prometheus",
    "TracingObserver": "kvoffload.instrumentation.tracing",
    "OTelMetricsBridge": "kvoffload.instrumentation.otel_metrics",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload.instrumentation' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
