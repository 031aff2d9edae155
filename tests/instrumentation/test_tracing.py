"""TracingObserver: span names, attributes and parentage, log records
correlated with the step span, sampling, and inertness without providers."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from opentelemetry import _logs, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, StatusCode
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from kvoffload.event_log import EventLog
from kvoffload.instrumentation import TracingObserver
from kvoffload.instrumentation.tracing import Attr, LogEvent
from kvoffload.runtime.commands import CommandResult
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.observer import RequestRecord, TransferRecord

from .conftest import OTel, make_otel

MS = 1_000_000


def _by_name(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _one_step(obs: TracingObserver, step: int = 1) -> tuple[int, int]:
    """Drive one step with a store job, a load job, a request and an eviction."""
    t0 = time.perf_counter_ns()
    obs.step_started(step, t0)
    obs.transfer_finished(TransferRecord(7, "store", 4, 65536, t0 - 3 * MS, t0 + 1 * MS, True))
    obs.transfer_finished(TransferRecord(8, "load", 2, 32768, t0, t0 + 2 * MS, False))
    obs.request_finished(RequestRecord(42, step, 256, 64, 128, 64, t0 + 1 * MS, t0 + 3 * MS))
    obs.blocks_evicted(step, 5, "arc", {"t1": 3, "t2": 2})
    t1 = t0 + 5 * MS
    obs.step_finished(step, t0, t1, requests=1)
    return t0, t1


def test_tracing_spans_names_attributes_and_parents(otel: OTel) -> None:
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    t0, t1 = _one_step(obs)
    spans = otel.spans.get_finished_spans()
    assert sorted(s.name for s in spans) == [
        "kvoffload.request",
        "kvoffload.step",
        "kvoffload.transfer",
        "kvoffload.transfer",
    ]
    (step,) = _by_name(spans, "kvoffload.step")
    assert step.attributes == {"kvoffload.step": 1, "kvoffload.step.requests": 1}
    assert step.kind == SpanKind.INTERNAL
    assert step.end_time is not None and step.start_time is not None
    assert step.end_time - step.start_time == t1 - t0
    assert abs(step.start_time - time.time_ns()) < 60 * 10**9  # converted to epoch time
    assert step.instrumentation_scope is not None
    assert step.instrumentation_scope.name == "kvoffload"

    store, load = sorted(_by_name(spans, "kvoffload.transfer"), key=lambda s: s.start_time or 0)
    assert store.attributes == {
        "kvoffload.transfer.job_id": 7,
        "kvoffload.transfer.direction": "store",
        "kvoffload.transfer.blocks": 4,
        "kvoffload.transfer.bytes": 65536,
        "kvoffload.transfer.outcome": "ok",
    }
    # the job's own times: submitted before the step began
    assert store.start_time == step.start_time - 3 * MS
    assert store.end_time == step.start_time + 1 * MS
    assert load.attributes is not None
    assert load.attributes["kvoffload.transfer.outcome"] == "failed"
    assert load.status.status_code == StatusCode.ERROR

    (req,) = _by_name(spans, "kvoffload.request")
    assert req.attributes == {
        "kvoffload.request.id": 42,
        "kvoffload.step": 1,
        "gen_ai.usage.input_tokens": 256,
        "gen_ai.usage.cache_read.input_tokens": 64 + 128,
        "kvoffload.request.gpu_hit_tokens": 64,
        "kvoffload.request.cpu_hit_tokens": 128,
        "kvoffload.request.computed_tokens": 64,
        "kvoffload.request.truncated_tokens": 0,
    }
    # from scheduling to completion (its load included)
    assert req.start_time is not None and step.start_time is not None
    assert req.end_time is not None
    assert (req.start_time - step.start_time, req.end_time - step.start_time) == (MS, 3 * MS)

    for child in (store, load, req):
        assert child.parent is not None
        assert child.parent.span_id == step.context.span_id
        assert child.context.trace_id == step.context.trace_id


def test_tracing_eviction_log_is_correlated_with_the_step_span(otel: OTel) -> None:
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    _one_step(obs)
    (step,) = _by_name(otel.spans.get_finished_spans(), "kvoffload.step")
    (log,) = otel.logs.get_finished_logs()
    rec = log.log_record
    assert rec.event_name == LogEvent.EVICTION == "kvoffload.eviction"
    assert rec.trace_id == step.context.trace_id
    assert rec.span_id == step.context.span_id
    assert rec.attributes is not None
    assert dict(rec.attributes) == {
        "kvoffload.step": 1,
        "kvoffload.eviction.blocks": 5,
        # which lists the victims left (issue 18)
        "kvoffload.eviction.blocks.t1": 3,
        "kvoffload.eviction.blocks.t2": 2,
        "kvoffload.policy": "arc",
    }
    assert rec.severity_number == _logs.SeverityNumber.DEBUG
    assert rec.body == "evicted 5 offloaded blocks (arc: 3 from t1, 2 from t2)"


def test_tracing_policy_switch_is_a_log_record_in_the_current_span(otel: OTel) -> None:
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    result = CommandResult(
        kind="switch_policy",
        applied_at_step=12,
        policy="arc",
        policy_version=3,
        detail={"from": "lru", "to": "arc"},
    )
    tracer = otel.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("PUT /v1/policy") as admin:
        obs.command_applied(result)
    obs.command_applied(CommandResult("pause", 12, "arc", 3))
    switch, pause = (r.log_record for r in otel.logs.get_finished_logs())
    assert switch.event_name == "kvoffload.policy_switch"
    assert switch.severity_number == _logs.SeverityNumber.INFO
    assert switch.trace_id == admin.get_span_context().trace_id
    assert switch.span_id == admin.get_span_context().span_id
    assert switch.attributes is not None
    assert dict(switch.attributes) == {
        "kvoffload.command": "switch_policy",
        "kvoffload.step": 12,
        "kvoffload.policy": "arc",
        "kvoffload.policy.version": 3,
        "kvoffload.policy.previous": "lru",
    }
    assert pause.event_name == "kvoffload.command"
    assert pause.attributes is not None and pause.attributes["kvoffload.command"] == "pause"
    assert not pause.trace_id  # no span was current
    assert not _by_name(otel.spans.get_finished_spans(), "kvoffload.step")


def test_tracing_reports_missed_events_rate_limited(otel: OTel) -> None:
    log = EventLog(capacity=2)
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider, missed_events_interval_s=60)
    for _ in range(4):
        log.append("cleared")
    assert log.read(after_seq=1).missed == 1  # before the observer watches: not reported
    obs.watch_event_log(log)
    for _ in range(10):
        log.append("cleared")  # overwritten unread: nobody lost them, nothing to report
    obs.step_started(1, time.perf_counter_ns())
    obs.step_finished(1, 0, time.perf_counter_ns(), 0)
    assert otel.logs.get_finished_logs() == ()
    log.read(after_seq=7)  # the ring holds 13 and 14: 8..12 are gone
    obs.step_started(2, time.perf_counter_ns())
    obs.step_finished(2, 0, time.perf_counter_ns(), 0)
    log.read(after_seq=9)  # 10..12
    obs.step_started(3, time.perf_counter_ns())
    obs.step_finished(3, 0, time.perf_counter_ns(), 0)  # within the interval: held back
    records = [r.log_record for r in otel.logs.get_finished_logs()]
    assert [r.event_name for r in records] == ["kvoffload.events_missed"]
    assert records[0].attributes is not None
    assert records[0].attributes[Attr.EVENTS_MISSED] == 5
    assert records[0].severity_number == _logs.SeverityNumber.WARN
    step2 = _by_name(otel.spans.get_finished_spans(), "kvoffload.step")[1]
    assert records[0].trace_id == step2.context.trace_id
    obs.close()  # flushes what was held back
    records = [r.log_record for r in otel.logs.get_finished_logs()]
    assert len(records) == 2 and records[1].attributes is not None
    assert records[1].attributes[Attr.EVENTS_MISSED] == 3
    assert records[1].attributes[Attr.EVENTS_MISSED_TOTAL] == 9


def test_tracing_without_providers_does_nothing_and_ignores_globals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_globals(*_: object, **__: object) -> None:
        raise AssertionError("the library must not use the global OTel providers")

    for module, name in (
        (trace, "get_tracer_provider"),
        (trace, "get_tracer"),
        (_logs, "get_logger_provider"),
        (_logs, "get_logger"),
    ):
        monkeypatch.setattr(module, name, no_globals)
    obs = TracingObserver()
    _one_step(obs)
    obs.command_applied(CommandResult("reset", 1, "lru", 1))
    obs.close()
    obs_logs_only = TracingObserver(None, make_otel().logger_provider)
    _one_step(obs_logs_only)  # logs on, traces off: still no global access


class CountingSampler(Sampler):
    """Samples nothing and counts the decisions it was asked for."""

    def __init__(self) -> None:
        self.calls = 0

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        self.calls += 1
        return SamplingResult(Decision.DROP)

    def get_description(self) -> str:
        return "CountingSampler"


def test_tracing_unsampled_step_creates_no_child_spans_or_eviction_logs() -> None:
    sampler = CountingSampler()
    otel = make_otel(sampler)
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    for step in range(1, 11):
        _one_step(obs, step)
    assert sampler.calls == 10  # one decision per step; children were never started
    assert otel.spans.get_finished_spans() == ()
    assert otel.logs.get_finished_logs() == ()  # eviction logs follow trace sampling
    obs.command_applied(CommandResult("switch_policy", 10, "arc", 2, {"from": "lru"}))
    assert len(otel.logs.get_finished_logs()) == 1  # switches are always logged


def test_tracing_eviction_logs_all_mode_ignores_sampling() -> None:
    otel = make_otel(ALWAYS_OFF)
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider, eviction_logs="all")
    _one_step(obs)
    assert [r.log_record.event_name for r in otel.logs.get_finished_logs()] == [
        "kvoffload.eviction"
    ]
    otel = make_otel()
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider, eviction_logs="off")
    _one_step(obs)
    assert otel.logs.get_finished_logs() == ()


def test_tracing_ratio_sampling_keeps_whole_steps() -> None:
    otel = make_otel(ParentBased(TraceIdRatioBased(0.3)))
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    for step in range(1, 201):
        _one_step(obs, step)
    spans = otel.spans.get_finished_spans()
    steps = _by_name(spans, "kvoffload.step")
    assert 20 < len(steps) < 120
    # every sampled step carries all of its children, and nothing else is exported
    assert len(spans) == 4 * len(steps)
    step_ids = {s.context.span_id for s in steps}
    assert all(
        s.parent is not None and s.parent.span_id in step_ids for s in spans if s not in steps
    )
    assert len(otel.logs.get_finished_logs()) == len(steps)


def test_tracing_with_the_real_engine(otel: OTel) -> None:
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    engine = Engine(
        EngineConfig(policy="lru", num_cpu_blocks=32, num_gpu_blocks=64, device="cpu"),
        observers=[obs],
    )
    obs.watch_event_log(engine.event_log)
    engine.run(max_steps=4)
    engine.switch_policy("arc")
    snap = engine.run(max_steps=4)
    r = snap.runtime
    spans = otel.spans.get_finished_spans()
    steps = _by_name(spans, "kvoffload.step")
    assert len(steps) == r.steps == 8
    assert len(_by_name(spans, "kvoffload.transfer")) == r.load_jobs + r.store_jobs
    requests = _by_name(spans, "kvoffload.request")
    assert len(requests) == r.requests
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in requests) == r.prompt_tokens  # type: ignore[index,misc]
    assert (
        sum(s.attributes["kvoffload.request.cpu_hit_tokens"] for s in requests)  # type: ignore[index,misc]
        == r.cpu_hit_tokens
    )
    step_ids = {s.context.span_id for s in steps}
    in_step = [s for s in spans if s.parent is not None and s.parent.span_id in step_ids]
    assert len(in_step) >= len(requests)  # requests always run inside a step
    events = [rec.log_record.event_name for rec in otel.logs.get_finished_logs()]
    assert events.count("kvoffload.policy_switch") == 1
    assert snap.manager.counters.evictions and "kvoffload.eviction" in events


def test_tracing_request_whose_load_finished_later_is_a_child_of_its_step(otel: OTel) -> None:
    # issue 18: the request is reported when its load finished, a step later;
    # its span still belongs to the step that served it
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    t0 = time.perf_counter_ns()
    obs.step_started(1, t0)
    obs.step_finished(1, t0, t0 + MS, requests=1)
    obs.step_started(2, t0 + 2 * MS)
    obs.request_finished(RequestRecord(9, 1, 128, 0, 0, 128, t0, t0 + 2 * MS))
    obs.step_finished(2, t0 + 2 * MS, t0 + 3 * MS, requests=0)
    spans = otel.spans.get_finished_spans()
    steps = {
        dict(s.attributes or {})["kvoffload.step"]: s for s in _by_name(spans, "kvoffload.step")
    }
    (req,) = _by_name(spans, "kvoffload.request")
    assert req.parent is not None and steps[1].context is not None
    assert req.parent.span_id == steps[1].context.span_id
    assert req.attributes is not None and req.attributes["kvoffload.request.computed_tokens"] == 128


def test_tracing_jobs_and_requests_finished_between_steps_belong_to_the_last(otel: OTel) -> None:
    # found by an audit: a load that finished in a pause's drain, after its
    # step had ended, made its transfer and request spans the roots of traces
    # of their own (sampled apart from their step)
    obs = TracingObserver(otel.tracer_provider, otel.logger_provider)
    t0 = time.perf_counter_ns()
    obs.step_started(1, t0)
    obs.step_finished(1, t0, t0 + MS, requests=1)
    obs.transfer_finished(TransferRecord(5, "load", 4, 4096, t0, t0 + 2 * MS, True))
    obs.request_finished(RequestRecord(9, 1, 128, 0, 64, 64, t0, t0 + 2 * MS))
    spans = otel.spans.get_finished_spans()
    (step,) = _by_name(spans, "kvoffload.step")
    assert step.context is not None
    for name in ("kvoffload.transfer", "kvoffload.request"):
        (child,) = _by_name(spans, name)
        assert child.parent is not None and child.parent.span_id == step.context.span_id, name
