"""Exemplars: the step and transfer histograms name the trace of a sampled step
in OpenMetrics, so a dashboard can go from a slow bucket to the step's trace.
A real engine, the SDK exporting into memory, and prometheus_client's own
OpenMetrics parser reading the exposition back."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvoffload.instrumentation import PrometheusObserver, TracingObserver
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine

from .conftest import OTel, make_otel

STEPS = 30
HISTOGRAMS = (
    "kvoffload_runtime_step_duration_seconds",
    "kvoffload_transfer_duration_seconds",
    "kvoffload_transfer_size_bytes",
)


def _run(sampler: Sampler) -> tuple[OTel, CollectorRegistry]:
    otel = make_otel(sampler)
    tracing = TracingObserver(otel.tracer_provider)
    registry = CollectorRegistry()
    prometheus = PrometheusObserver(registry=registry, exemplars=tracing.exemplar)
    config = EngineConfig(num_cpu_blocks=64, num_gpu_blocks=64, device="cpu", policy="lru")
    # prometheus first, as the service orders them: it reads the step's span
    # before the tracing observer ends it
    Engine(config, observers=[prometheus, tracing]).run(max_steps=STEPS)
    return otel, registry


def _exemplars(registry: CollectorRegistry) -> dict[str, list[Any]]:
    """Each histogram's bucket samples that carry an exemplar."""
    text = generate_openmetrics(registry).decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in HISTOGRAMS:
            out[family.name] = [
                s for s in family.samples if s.name.endswith("_bucket") and s.exemplar
            ]
    return out


def test_sampled_steps_are_the_exemplars_of_the_histograms() -> None:
    otel, registry = _run(ParentBased(TraceIdRatioBased(1.0)))
    steps = {
        (format(s.context.trace_id, "032x"), format(s.context.span_id, "016x")): s
        for s in otel.spans.get_finished_spans()
        if s.name == "kvoffload.step"
    }
    assert len(steps) == STEPS
    found = _exemplars(registry)
    assert set(found) == set(HISTOGRAMS)
    for name, samples in found.items():
        assert samples, f"{name} has no exemplar"
        for sample in samples:
            ex = sample.exemplar
            assert set(ex.labels) == {"trace_id", "span_id"}
            # the very step span the SDK exported
            step = steps[(ex.labels["trace_id"], ex.labels["span_id"])]
            assert step.attributes is not None and step.attributes["kvoffload.step"] >= 1
            # an exemplar is an observation of its own bucket
            le = float(sample.labels["le"])
            assert ex.value <= le
    step_samples = found["kvoffload_runtime_step_duration_seconds"]
    assert max(s.exemplar.value for s in step_samples) > 0


def test_no_exemplar_without_sampled_steps_nor_in_the_text_format() -> None:
    _, registry = _run(ALWAYS_OFF)
    assert all(samples == [] for samples in _exemplars(registry).values())
    # sampled, but the classic text format has no place for exemplars: its
    # exposition is the one it was
    _, sampled = _run(ParentBased(TraceIdRatioBased(1.0)))
    assert b"trace_id" not in generate_latest(sampled)
    assert b"trace_id" in generate_openmetrics(sampled)


def test_tracing_observer_exemplar_names_the_step_span() -> None:
    otel = make_otel()
    tracing = TracingObserver(otel.tracer_provider)
    assert tracing.exemplar() is None  # no step yet
    tracing.step_started(1, 0)
    in_progress = tracing.exemplar()
    assert in_progress is not None and tracing.exemplar(1) == in_progress
    tracing.step_finished(1, 0, 10, requests=0)
    (span,) = otel.spans.get_finished_spans()
    assert in_progress == {
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
    }
    assert tracing.exemplar(2) is None  # a step it never saw
    # an unsampled step, or no tracer provider: never
    for tracer_provider in (make_otel(ALWAYS_OFF).tracer_provider, None):
        other = TracingObserver(tracer_provider)
        other.step_started(1, 0)
        assert other.exemplar() is None and other.exemplar(1) is None
