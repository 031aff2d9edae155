"""OpenTelemetry traces and log records for the engine (``opentelemetry-api`` only).

:class:`TracingObserver` turns engine hooks into:

- a ``kvoffload.step`` span per engine step;
- a ``kvoffload.transfer`` span per transfer job, with the job's own start and
  end times, as a child of the step in which it finished;
- a ``kvoffload.request`` span per request, with token attribution
  (``gen_ai.usage.*`` and ``kvoffload.request.*`` attributes);
- log records (not span events) for evictions, applied commands such as
  policy switches, and event-log records readers missed, each carrying the
  context of the step span in progress so that backends correlate them.

The caller passes the providers. Without them the observer is inert: it
never falls back to the global providers, so the library exports nothing
unless an application configured an SDK and handed it over.

Sampling: the step span is the sampling decision for everything inside the
step. When it is not recording, no transfer or request span is created and
no attribute is built, which is what keeps tracing cheap at low sampling
ratios (see ``docs/observability.md``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry._logs import LoggerProvider, LogRecord, SeverityNumber
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.util.types import AnyValue, Attributes

from kvoffload._version import __version__
from kvoffload.event_log import EventLog
from kvoffload.runtime.commands import CommandResult
from kvoffload.runtime.observer import EngineObserver, RequestRecord, TransferRecord

__all__ = [
    "SPAN_NAMES",
    "Attr",
    "EvictionLogs",
    "LogEvent",
    "TracingObserver",
]

#: instrumentation scope of the tracer and the logger
SCOPE = "kvoffload"

SPAN_NAMES = ("kvoffload.step", "kvoffload.transfer", "kvoffload.request")


class Attr:
    """Attribute names used on spans and log records (documented in
    ``docs/observability.md``)."""

    STEP = "kvoffload.step"
    STEP_REQUESTS = "kvoffload.step.requests"
    TRANSFER_JOB_ID = "kvoffload.transfer.job_id"
    TRANSFER_DIRECTION = "kvoffload.transfer.direction"
    TRANSFER_BLOCKS = "kvoffload.transfer.blocks"
    TRANSFER_BYTES = "kvoffload.transfer.bytes"
    TRANSFER_OUTCOME = "kvoffload.transfer.outcome"
    REQUEST_ID = "kvoffload.request.id"
    #: OTel GenAI semantic conventions: all prompt tokens of the request
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    #: OTel GenAI semantic conventions: prompt tokens whose KV was reused
    #: rather than computed (GPU prefix hit + CPU tier hit)
    CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
    REQUEST_GPU_HIT_TOKENS = "kvoffload.request.gpu_hit_tokens"
    REQUEST_CPU_HIT_TOKENS = "kvoffload.request.cpu_hit_tokens"
    REQUEST_COMPUTED_TOKENS = "kvoffload.request.computed_tokens"
    REQUEST_TRUNCATED_TOKENS = "kvoffload.request.truncated_tokens"
    EVICTED_BLOCKS = "kvoffload.eviction.blocks"
    POLICY = "kvoffload.policy"
    POLICY_PREVIOUS = "kvoffload.policy.previous"
    POLICY_VERSION = "kvoffload.policy.version"
    COMMAND = "kvoffload.command"
    EVENTS_MISSED = "kvoffload.events.missed"
    EVENTS_MISSED_TOTAL = "kvoffload.events.missed_total"


class LogEvent:
    """``event_name`` of the log records the observer emits."""

    EVICTION = "kvoffload.eviction"
    POLICY_SWITCH = "kvoffload.policy_switch"
    COMMAND = "kvoffload.command"
    EVENTS_MISSED = "kvoffload.events_missed"


#: ``"sampled"``: an eviction log record only inside a recorded step span
#: (exact counts are in ``kvoffload_evictions_total``); ``"all"``: every
#: ``blocks_evicted`` call; ``"off"``: none.
EvictionLogs = Literal["sampled", "all", "off"]

# Hooks may pass monotonic (perf_counter) nanoseconds; OTel wants epoch ns.
# Anything below this (~1973 as epoch ns) is taken as monotonic.
_EPOCH_NS_FLOOR = 10**17
#: steps whose span context a late request may still be parented to
_RECENT_STEPS = 64


class TracingObserver(EngineObserver):
    """Spans and log records from engine hooks.

    Args:
        tracer_provider: where spans go; ``None`` = no spans.
        logger_provider: where log records go; ``None`` = no log records.
        event_log: the event log whose readers' missed records are reported
            (e.g. ``engine.event_log``); may also be set later with
            :meth:`watch_event_log`.
        eviction_logs: see :data:`EvictionLogs`.
        missed_events_interval_s: at most one "events missed" record per
            interval, carrying the count since the previous one.

    Hooks run on the engine thread; the observer keeps no lock.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        logger_provider: LoggerProvider | None = None,
        *,
        event_log: EventLog | None = None,
        eviction_logs: EvictionLogs = "sampled",
        missed_events_interval_s: float = 10.0,
    ) -> None:
        self._tracing = tracer_provider is not None
        self._logging = logger_provider is not None
        tp = tracer_provider if tracer_provider is not None else trace.NoOpTracerProvider()
        self._tracer = tp.get_tracer(SCOPE, __version__)
        self._logger = (
            logger_provider.get_logger(SCOPE, __version__) if logger_provider is not None else None
        )
        self._eviction_logs: EvictionLogs = eviction_logs
        self._missed_interval_ns = int(missed_events_interval_s * 1e9)
        self._event_log: EventLog | None = None
        self._missed_seen = 0
        self._missed_reported_ns = 0
        # the step in progress
        self._step_span: Span | None = None
        self._step_ctx: Context | None = None
        self._step_recording = False
        self._step_start_ns = 0
        #: (recording?, context) of the last steps, for requests whose load
        #: finishes in a later step than the one that served them
        self._recent_steps: dict[int, tuple[bool, Context | None]] = {}
        self._mono_offset_ns = time.time_ns() - time.perf_counter_ns()
        if event_log is not None:
            self.watch_event_log(event_log)

    def watch_event_log(self, event_log: EventLog | None) -> None:
        """Report records that readers of ``event_log`` missed (checked once
        per step): records they asked for that were already overwritten or
        drained. Records overwritten unread by anyone are no loss to report."""
        self._event_log = event_log
        self._missed_seen = event_log.missed if event_log is not None else 0

    def _epoch_ns(self, t_ns: int) -> int:
        return t_ns if t_ns >= _EPOCH_NS_FLOOR else t_ns + self._mono_offset_ns

    # -- spans ----------------------------------------------------------------

    def step_started(self, step: int, start_ns: int) -> None:
        if not self._tracing:
            return
        if self._step_span is not None:  # a step that never finished
            self._step_span.end()
        span = self._tracer.start_span(
            "kvoffload.step", kind=SpanKind.INTERNAL, start_time=self._epoch_ns(start_ns)
        )
        self._step_span = span
        self._step_start_ns = start_ns
        self._step_recording = span.is_recording()
        if self._step_recording:
            span.set_attribute(Attr.STEP, step)
            self._step_ctx = trace.set_span_in_context(span)
        else:
            self._step_ctx = None
        recent = self._recent_steps
        recent[step] = (self._step_recording, self._step_ctx)
        if len(recent) > _RECENT_STEPS:
            del recent[next(iter(recent))]

    def step_finished(self, step: int, start_ns: int, end_ns: int, requests: int) -> None:
        self.check_missed()
        span = self._step_span
        if span is None:
            return
        if self._step_recording:
            span.set_attribute(Attr.STEP_REQUESTS, requests)
        span.end(end_time=self._epoch_ns(end_ns))
        self._step_span = None
        self._step_ctx = None
        self._step_recording = False

    def exemplar(self, step: int | None = None) -> Mapping[str, str] | None:
        """``trace_id`` and ``span_id`` (hex) of the span of ``step`` (``None``:
        the step in progress, or the last one), or ``None`` when that step was
        not sampled or is too old: the exemplar that links a metric observed
        in the step to its trace (:class:`~kvoffload.instrumentation.PrometheusObserver`'s
        ``exemplars``). Only sampled steps have one, and there is no cost on
        the others."""
        recent = self._recent_steps
        if step is None:
            step = next(reversed(recent), None)
        recording, ctx = recent.get(step, (False, None)) if step is not None else (False, None)
        if not recording:
            return None
        ids = trace.get_current_span(ctx).get_span_context()
        return {"trace_id": format(ids.trace_id, "032x"), "span_id": format(ids.span_id, "016x")}

    def _child_context(self) -> tuple[bool, Context | None]:
        """(create a child span?, its parent context): the step in progress,
        or between steps the last one (the drain of a pause, a stop or the end
        of a run finishes its jobs); before any step the current context
        decides."""
        if self._step_span is not None:
            return self._step_recording, self._step_ctx
        recent = self._recent_steps
        return recent[next(reversed(recent))] if recent else (True, None)

    def transfer_finished(self, record: TransferRecord) -> None:
        if not self._tracing:
            return
        create, parent = self._child_context()
        if not create:
            return
        span = self._tracer.start_span(
            "kvoffload.transfer",
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=self._epoch_ns(record.submitted_ns),
        )
        if span.is_recording():
            span.set_attributes(
                {
                    Attr.TRANSFER_JOB_ID: record.job_id,
                    Attr.TRANSFER_DIRECTION: record.direction,
                    Attr.TRANSFER_BLOCKS: record.blocks,
                    Attr.TRANSFER_BYTES: record.nbytes,
                    Attr.TRANSFER_OUTCOME: "ok" if record.ok else "failed",
                }
            )
            if not record.ok:
                span.set_status(Status(StatusCode.ERROR, "transfer job failed"))
        span.end(end_time=self._epoch_ns(record.finished_ns))

    def request_finished(self, record: RequestRecord) -> None:
        if not self._tracing:
            return
        # The engine reports a request once all of it is known: at once, or
        # when the load of its CPU hits finished, possibly in a later step.
        # Its span is a child of the step that served it, while that step's
        # context is remembered, and covers scheduling .. completion.
        create, parent = self._recent_steps.get(record.step) or self._child_context()
        if not create:
            return
        start = self._epoch_ns(record.started_ns) if record.started_ns else None
        span = self._tracer.start_span(
            "kvoffload.request", context=parent, kind=SpanKind.INTERNAL, start_time=start
        )
        if span.is_recording():
            span.set_attributes(
                {
                    Attr.REQUEST_ID: record.request_id,
                    Attr.STEP: record.step,
                    Attr.INPUT_TOKENS: record.prompt_tokens,
                    Attr.CACHE_READ_INPUT_TOKENS: record.gpu_hit_tokens + record.cpu_hit_tokens,
                    Attr.REQUEST_GPU_HIT_TOKENS: record.gpu_hit_tokens,
                    Attr.REQUEST_CPU_HIT_TOKENS: record.cpu_hit_tokens,
                    Attr.REQUEST_COMPUTED_TOKENS: record.computed_tokens,
                    Attr.REQUEST_TRUNCATED_TOKENS: record.truncated_tokens,
                }
            )
        span.end(end_time=self._epoch_ns(record.finished_ns) if record.finished_ns else None)

    # -- log records ----------------------------------------------------------

    def _log_context(self) -> Context:
        return self._step_ctx if self._step_ctx is not None else otel_context.get_current()

    def _emit(
        self,
        event_name: str,
        severity: SeverityNumber,
        body: AnyValue,
        attributes: Attributes,
    ) -> None:
        logger = self._logger
        if logger is None:
            return
        ctx = self._log_context()
        if not logger.enabled(context=ctx, severity_number=severity, event_name=event_name):
            return
        logger.emit(
            LogRecord(
                timestamp=time.time_ns(),
                context=ctx,
                severity_number=severity,
                severity_text=severity.name,
                body=body,
                attributes=attributes,
                event_name=event_name,
            )
        )

    def blocks_evicted(self, step: int, count: int, policy: str, lists: Mapping[str, int]) -> None:
        mode = self._eviction_logs
        if not self._logging or mode == "off":
            return
        if mode == "sampled" and not self._step_recording:
            return
        attrs: dict[str, AnyValue] = {
            Attr.STEP: step,
            Attr.EVICTED_BLOCKS: count,
            Attr.POLICY: policy,
        }
        for name, n in lists.items():
            attrs[f"{Attr.EVICTED_BLOCKS}.{name}"] = n
        where = ", ".join(f"{n} from {name}" for name, n in lists.items())
        self._emit(
            LogEvent.EVICTION,
            SeverityNumber.DEBUG,
            f"evicted {count} offloaded blocks ({policy}: {where})",
            attrs,
        )

    def command_applied(self, result: CommandResult) -> None:
        if not self._logging:
            return
        attrs: dict[str, AnyValue] = {
            Attr.COMMAND: result.kind,
            Attr.STEP: result.applied_at_step,
            Attr.POLICY: result.policy,
            Attr.POLICY_VERSION: result.policy_version,
        }
        if result.kind == "switch_policy":
            previous = result.detail.get("from") or result.detail.get("previous")
            if previous:
                attrs[Attr.POLICY_PREVIOUS] = previous
            body = (
                f"eviction policy switched to {result.policy} "
                f"(version {result.policy_version}) after step {result.applied_at_step}"
            )
            self._emit(LogEvent.POLICY_SWITCH, SeverityNumber.INFO, body, attrs)
        else:
            body = f"command {result.kind} applied after step {result.applied_at_step}"
            self._emit(LogEvent.COMMAND, SeverityNumber.INFO, body, attrs)

    def check_missed(self) -> None:
        """Report the records readers of the watched event log missed since
        the last report: one WARN log record, at most one per
        ``missed_events_interval_s`` (a count that must wait is reported by a
        later call, or by :meth:`close`). ``step_finished`` calls it; a host
        with no engine loop of its own calls it once per step of its own
        (inside vLLM, each scheduler step). No cost without a logger provider
        or a watched log."""
        log = self._event_log
        if log is None or not self._logging:
            return
        missed = log.missed
        new = missed - self._missed_seen
        if new <= 0:
            return
        now = time.monotonic_ns()
        if self._missed_reported_ns and now - self._missed_reported_ns < self._missed_interval_ns:
            return  # report the accumulated count at the next allowed time
        self._missed_seen = missed
        self._missed_reported_ns = now
        self._emit(
            LogEvent.EVENTS_MISSED,
            SeverityNumber.WARN,
            f"event-log readers missed {new} records: they fell behind the ring "
            f"(capacity {log.capacity}) or a drain took them",
            {Attr.EVENTS_MISSED: new, Attr.EVENTS_MISSED_TOTAL: missed},
        )

    def close(self) -> None:
        """End a step span left open; report pending misses. Providers are the
        caller's to flush and shut down."""
        self._missed_reported_ns = 0
        self.check_missed()
        if self._step_span is not None:
            self._step_span.end()
            self._step_span = None
            self._step_ctx = None
            self._step_recording = False
