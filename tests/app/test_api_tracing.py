"""Admin actions are traced: one span per state-changing request, with what was
asked, what happened and when it took effect; always sampled by the service's
default sampler."""

from __future__ import annotations

from typing import Any

import pytest
from api_support import ADMIN_HEADERS, TestClient, small_settings
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import StatusCode

from app.main import create_app
from app.telemetry import AdminAlwaysSampler, Telemetry


@pytest.fixture
def traced() -> Any:
    exporter = InMemorySpanExporter()
    # ratio 0: only what AdminAlwaysSampler forces through is recorded
    provider = TracerProvider(sampler=AdminAlwaysSampler(ParentBased(TraceIdRatioBased(0.0))))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(
        small_settings(), telemetry_factory=lambda: Telemetry(tracer_provider=provider)
    )
    with TestClient(app) as client:
        yield client, exporter


def _admin_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("kvoffload.admin.")]


def test_policy_switch_span_records_request_and_effect(traced: Any) -> None:
    client, exporter = traced
    r = client.put(
        "/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc", "expected_version": 1}
    )
    assert r.status_code == 200
    (span,) = _admin_spans(exporter)
    assert span.name == "kvoffload.admin.switch_policy"
    attrs = dict(span.attributes or {})
    assert attrs["kvoffload.admin.requested_policy"] == "arc"
    assert attrs["kvoffload.admin.expected_version"] == 1
    assert attrs["kvoffload.admin.outcome"] == "applied"
    assert attrs["kvoffload.policy"] == "arc"
    assert attrs["kvoffload.policy.version"] == r.json()["version"] == 2
    assert attrs["kvoffload.step"] == r.json()["applied_at_step"]
    # the engine's own spans were sampled out (ratio 0): admin spans are not
    assert not [s for s in exporter.get_finished_spans() if s.name == "kvoffload.step"]


def test_refused_switch_span_carries_the_error_code(traced: Any) -> None:
    client, exporter = traced
    r = client.put(
        "/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc", "expected_version": 7}
    )
    assert r.status_code == 409
    (span,) = _admin_spans(exporter)
    assert span.attributes is not None
    assert span.attributes["kvoffload.admin.outcome"] == "version_conflict"
    assert span.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/v1/runtime:pause", None, "kvoffload.admin.pause"),
        ("/v1/runtime:resume", None, "kvoffload.admin.resume"),
        ("/v1/cache:reset", {"confirm": True}, "kvoffload.admin.reset"),
        ("/v1/events:drain", {"limit": 5}, "kvoffload.admin.drain_events"),
    ],
)
def test_every_admin_action_is_a_span(traced: Any, path: str, body: Any, name: str) -> None:
    client, exporter = traced
    r = client.post(path, headers=ADMIN_HEADERS, json=body)
    assert r.status_code == 200, r.text
    spans = _admin_spans(exporter)
    assert [s.name for s in spans] == [name]
    assert spans[0].attributes is not None
    # a resume of the running engine changes nothing (docs/api.md: no command
    # the metrics, spans and markers count); it said "applied" (audit)
    outcome = "unchanged" if name.endswith("resume") else "applied"
    assert spans[0].attributes["kvoffload.admin.outcome"] == outcome
    if name.endswith("drain_events"):
        assert spans[0].attributes["kvoffload.events.drained"] == len(r.json()["events"])


def test_reads_are_not_traced_as_admin_actions(traced: Any) -> None:
    client, exporter = traced
    assert client.get("/v1/cache", headers=ADMIN_HEADERS).status_code == 200
    assert client.get("/v1/policy", headers=ADMIN_HEADERS).status_code == 200
    assert _admin_spans(exporter) == []
