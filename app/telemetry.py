"""OpenTelemetry SDK wiring for the service: the only place the SDK is configured.

:func:`setup_telemetry` reads the standard ``OTEL_*`` environment variables
and returns a :class:`Telemetry` holding the providers to hand to
:class:`kvoffload.instrumentation.TracingObserver`:

- a signal is exported only when an OTLP endpoint is set for it
  (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_{TRACES,LOGS,METRICS}_ENDPOINT``);
  with none set the providers are ``None``: nothing is exported, no thread
  is started, nothing is logged;
- ``OTEL_SDK_DISABLED=true`` turns everything off; ``OTEL_{TRACES,LOGS,METRICS}_EXPORTER=none``
  turns one signal off;
- export is OTLP over HTTP/protobuf through batch processors, so a slow or
  failing collector costs the engine nothing but dropped telemetry;
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` are honoured (read by
  the SDK itself); unset, the sampler is ``parentbased_traceidratio`` at
  :data:`DEFAULT_SAMPLING_RATIO`. Either way admin-action spans are always
  sampled (:class:`AdminAlwaysSampler` wraps the sampler chosen).

The exporters read the other OTLP variables themselves (headers, timeout,
compression, certificates), and the batch processors read ``OTEL_BSP_*`` /
``OTEL_BLRP_*``. Global providers are left alone unless ``set_global=True``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import (
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    SERVICE_VERSION,
    OTELResourceDetector,
    Resource,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from kvoffload._version import __version__
from kvoffload.instrumentation.tracing import TracingObserver

__all__ = [
    "DEFAULT_SAMPLING_RATIO",
    "DEFAULT_SERVICE_NAME",
    "Telemetry",
    "endpoint_configured",
    "service_instance_id",
    "setup_telemetry",
]

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "kvoffload"
#: one engine step in a hundred is traced when OTEL_TRACES_SAMPLER is unset
DEFAULT_SAMPLING_RATIO = 0.01

_SIGNALS = ("traces", "logs", "metrics")
_SUPPORTED_PROTOCOL = "http/protobuf"


def _env(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def endpoint_configured(signal: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether an OTLP endpoint is set for ``signal`` (traces, logs, metrics)."""
    env = os.environ if environ is None else environ
    return bool(
        _env(env, f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        or _env(env, "OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _wanted(signal: str, environ: Mapping[str, str]) -> bool:
    """Export ``signal``? An endpoint is set and its exporter is not ``none``."""
    if not endpoint_configured(signal, environ):
        return False
    exporter = _env(environ, f"OTEL_{signal.upper()}_EXPORTER").lower() or "otlp"
    names = {n.strip() for n in exporter.split(",") if n.strip()}
    if names == {"none"}:
        return False
    if "otlp" not in names:
        logger.warning(
            "OTEL_%s_EXPORTER=%s is not supported (only otlp or none); %s are not exported",
            signal.upper(),
            exporter,
            signal,
        )
        return False
    protocol = (
        _env(environ, f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or _env(environ, "OTEL_EXPORTER_OTLP_PROTOCOL")
        or _SUPPORTED_PROTOCOL
    )
    if protocol != _SUPPORTED_PROTOCOL:
        logger.warning(
            "OTLP protocol %r is not supported for %s; exporting over %s anyway "
            "(point the endpoint at the collector's OTLP/HTTP port, usually 4318)",
            protocol,
            signal,
            _SUPPORTED_PROTOCOL,
        )
    return True


def _disabled(environ: Mapping[str, str]) -> bool:
    return _env(environ, "OTEL_SDK_DISABLED").lower() == "true"


_instance: tuple[int, str] | None = None


def service_instance_id() -> str:
    """A random id for this process (a forked child gets its own)."""
    global _instance
    pid = os.getpid()
    if _instance is None or _instance[0] != pid:
        _instance = (pid, str(uuid.uuid4()))
    return _instance[1]


def _resource(service_version: str) -> Resource:
    """``service.*`` defaults under whatever OTEL_SERVICE_NAME /
    OTEL_RESOURCE_ATTRIBUTES say (the environment wins)."""
    from_env = OTELResourceDetector().detect().attributes
    defaults = {
        SERVICE_NAME: DEFAULT_SERVICE_NAME,
        SERVICE_VERSION: service_version,
        SERVICE_INSTANCE_ID: service_instance_id(),
    }
    return Resource.create({k: v for k, v in defaults.items() if k not in from_env})


#: spans whose name starts so are rare operator actions: always sampled
ADMIN_SPAN_PREFIX = "kvoffload.admin."


class AdminAlwaysSampler(Sampler):
    """Samples every admin-action span and defers the rest to ``delegate``.

    Engine steps run hundreds of times a second and are sampled at a low
    ratio; a policy switch or a reset happens a few times a day and is exactly
    what an operator looks for, so it must never be dropped by the ratio, nor
    by any other sampler an operator configures (``always_off`` included: it
    silences the engine's spans, not the record of who changed what).
    """

    def __init__(self, delegate: Sampler) -> None:
        self._delegate = delegate

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
        if name.startswith(ADMIN_SPAN_PREFIX):
            return ALWAYS_ON.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
        return self._delegate.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"AdminAlwaysSampler{{{self._delegate.get_description()}}}"


def _tracer_provider(
    environ: Mapping[str, str], resource: Resource, default_ratio: float
) -> TracerProvider:
    """A provider whose sampler is the one OTEL_TRACES_SAMPLER(_ARG) name (the
    SDK reads them itself when given no sampler), or the default ratio when
    unset, wrapped so that admin actions are always sampled."""
    configured = _env(environ, "OTEL_TRACES_SAMPLER")
    chosen = None if configured else ParentBased(TraceIdRatioBased(default_ratio))
    provider = TracerProvider(resource=resource, sampler=chosen, shutdown_on_exit=False)
    # before any tracer exists: each tracer takes the provider's sampler when made
    provider.sampler = AdminAlwaysSampler(provider.sampler)
    return provider


@dataclass(eq=False)
class Telemetry:
    """The configured providers (``None`` for a signal that is not exported)."""

    tracer_provider: TracerProvider | None = None
    logger_provider: LoggerProvider | None = None
    meter_provider: MeterProvider | None = None
    resource: Resource | None = None
    _closed: bool = field(default=False, init=False, repr=False)

    @property
    def exporting(self) -> bool:
        """Whether any signal is exported."""
        return any(
            p is not None for p in (self.tracer_provider, self.logger_provider, self.meter_provider)
        )

    def tracing_observer(self) -> TracingObserver:
        """An engine observer emitting spans and log records to these providers
        (inert when neither is configured)."""
        return TracingObserver(self.tracer_provider, self.logger_provider)

    def _providers(self) -> list[TracerProvider | LoggerProvider | MeterProvider]:
        return [
            p
            for p in (self.tracer_provider, self.logger_provider, self.meter_provider)
            if p is not None
        ]

    def _flush(self, timeout_s: float) -> bool:
        millis = int(timeout_s * 1000)
        return all([bool(p.force_flush(millis)) for p in self._providers()])

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is buffered, within ``timeout_s``; ``False`` if that
        was not enough (see :func:`_within`)."""
        done = _within(timeout_s, lambda: self._flush(timeout_s))
        if done is None:
            logger.warning("telemetry flush did not finish within %.1f s", timeout_s)
        return bool(done)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush, then stop the export threads, within ``timeout_s`` in all.
        Idempotent; ``True`` when everything was exported in time."""
        if self._closed:
            return True
        self._closed = True
        atexit.unregister(self.shutdown)
        if not self.exporting:
            return True

        def flush_and_stop() -> bool:
            flushed = self._flush(timeout_s)
            for provider in self._providers():
                provider.shutdown()
            return flushed

        done = _within(timeout_s, flush_and_stop)
        if done is None:
            logger.warning(
                "telemetry export did not finish within %.1f s (is the OTLP collector "
                "reachable?); what it still holds is dropped",
                timeout_s,
            )
            return False
        if not done:
            logger.warning("telemetry flush did not finish within %.1f s", timeout_s)
            return False
        logger.info("telemetry flushed")
        return True


def _within(timeout_s: float, work: Callable[[], bool]) -> bool | None:
    """``work()``'s answer, or ``None`` if it did not finish in ``timeout_s``.

    The SDK's own bounds do not hold against a collector that is down: the
    OTLP exporters retry with back-off up to their own timeout (10 s each by
    default) whatever timeout a flush is given. So the work runs on a daemon
    thread that is given up on at the deadline (what it still holds is
    dropped when the process exits)."""
    answer: list[bool] = []
    worker = threading.Thread(
        target=lambda: answer.append(work()), name="kvoffload-otel-flush", daemon=True
    )
    worker.start()
    worker.join(timeout_s)
    return answer[0] if answer else None


def setup_telemetry(
    *,
    service_version: str = __version__,
    metrics: bool = True,
    default_sampling_ratio: float = DEFAULT_SAMPLING_RATIO,
    set_global: bool = False,
) -> Telemetry:
    """Build providers from the ``OTEL_*`` environment (see the module doc).

    Args:
        service_version: ``service.version`` of the resource.
        metrics: build an OTLP :class:`MeterProvider` when a metrics endpoint
            is configured (the app mirrors the ``/metrics`` catalogue onto it
            with :class:`~kvoffload.instrumentation.otel_metrics.OTelMetricsBridge`);
            ``OTEL_METRICS_EXPORTER=none`` turns it off.
        default_sampling_ratio: trace-id ratio when ``OTEL_TRACES_SAMPLER``
            is unset (admin-action spans are always sampled).
        set_global: also install the providers as the process-wide OTel
            globals (for third-party instrumentation; kvoffload never needs it).
    """
    env = os.environ
    if _disabled(env):
        return Telemetry()
    want = {s: _wanted(s, env) for s in _SIGNALS}
    if not want["traces"] and not want["logs"] and not (metrics and want["metrics"]):
        return Telemetry()

    # Imported here so that a service without an endpoint never loads them.
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = _resource(service_version)
    telemetry = Telemetry(resource=resource)
    if want["traces"]:
        tp = _tracer_provider(env, resource, default_sampling_ratio)
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        telemetry.tracer_provider = tp
    if want["logs"]:
        lp = LoggerProvider(resource=resource, shutdown_on_exit=False)
        lp.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
        telemetry.logger_provider = lp
    if metrics and want["metrics"]:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        telemetry.meter_provider = MeterProvider(
            resource=resource, metric_readers=[reader], shutdown_on_exit=False
        )
    # the SDK's own exit hooks are unbounded against a collector that is down
    atexit.register(telemetry.shutdown)
    if set_global:
        _install_globals(telemetry)
    logger.info(
        "OpenTelemetry export on: traces=%s logs=%s metrics=%s",
        telemetry.tracer_provider is not None,
        telemetry.logger_provider is not None,
        telemetry.meter_provider is not None,
    )
    return telemetry


def _install_globals(telemetry: Telemetry) -> None:
    from opentelemetry import _logs, metrics, trace

    if telemetry.tracer_provider is not None:
        trace.set_tracer_provider(telemetry.tracer_provider)
    if telemetry.logger_provider is not None:
        _logs.set_logger_provider(telemetry.logger_provider)
    if telemetry.meter_provider is not None:
        metrics.set_meter_provider(telemetry.meter_provider)
