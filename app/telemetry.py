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
- export is OTLP through batch processors, so a slow or failing collector
  costs the engine nothing but dropped telemetry: over HTTP/protobuf, or over
  gRPC where ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or the signal's own
  ``OTEL_EXPORTER_OTLP_{TRACES,LOGS,METRICS}_PROTOCOL``) says ``grpc`` (the
  ``otlp-grpc`` extra);
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` are honoured; unset,
  the sampler is ``parentbased_traceidratio`` at
  :data:`DEFAULT_SAMPLING_RATIO`. Either way admin-action spans are always
  sampled (:class:`AdminAlwaysSampler` wraps the sampler chosen).

The exporters read the other OTLP variables themselves (headers, timeout,
compression, certificates), and the batch processors read ``OTEL_BSP_*`` /
``OTEL_BLRP_*``. :mod:`app.otel_settings` checks every setting of an exported
signal first: one the SDK would replace by a default, skip or fail on at
every export is a :class:`ConfigError`, raised before anything is built.
Global providers are left alone unless ``set_global=True``.
"""

from __future__ import annotations

import atexit
import importlib
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
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from app import otel_settings as otel
from kvoffload._version import __version__
from kvoffload.errors import ConfigError
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
#: each signal's exporter: module in the protocol's package, class
_EXPORTERS = {
    "traces": ("trace_exporter", "OTLPSpanExporter"),
    "logs": ("_log_exporter", "OTLPLogExporter"),
    "metrics": ("metric_exporter", "OTLPMetricExporter"),
}


def endpoint_configured(signal: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether an OTLP endpoint is set for ``signal`` (traces, logs, metrics)."""
    return otel.endpoint(signal, environ) is not None


def _exporter(signal: str, protocol: str) -> type:
    """The OTLP exporter class for ``signal`` over ``protocol``;
    :class:`ConfigError` when it is ``grpc`` and the gRPC exporter is not
    installed."""
    module, name = _EXPORTERS[signal]
    package = f"opentelemetry.exporter.otlp.proto.{otel.PROTOCOLS[protocol]}"
    try:
        exporter: type = getattr(importlib.import_module(f"{package}.{module}"), name)
    except ImportError as exc:
        if protocol != "grpc":
            raise
        raise ConfigError(
            f"exporting {signal} over OTLP/gRPC needs the "
            "gRPC exporter, which is not installed: pip install 'kvoffload[otlp-grpc]', or "
            "export over 'http/protobuf' to the collector's OTLP/HTTP port (usually 4318)"
        ) from exc
    return exporter


def _disabled(environ: Mapping[str, str]) -> bool:
    return otel.env(environ, "OTEL_SDK_DISABLED").lower() == "true"


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


def _tracer_provider(resource: Resource, sampler: Sampler) -> TracerProvider:
    """A provider with ``sampler``, wrapped so that admin actions are always
    sampled."""
    provider = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
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

    Raises:
        ConfigError: an ``OTEL_*`` setting of a signal to export that the
            SDK would not use as given (:mod:`app.otel_settings`), or ``grpc``
            without the gRPC exporter installed (the ``otlp-grpc`` extra);
            nothing is built.
    """
    env = os.environ
    if _disabled(env):
        return Telemetry()
    wanted = [s for s in _SIGNALS if (metrics or s != "metrics") and otel.exported(s, env)]
    if not wanted:
        return Telemetry()
    # Every setting checked and every exporter found before any provider is
    # built: a bad one is an error with nothing started. (The exporters are
    # imported here so that a service without an endpoint never loads them.)
    protocols = {s: otel.protocol(s, env) for s in wanted}
    otel.check(protocols, env)
    sampling = otel.sampler(env, default_sampling_ratio) if "traces" in protocols else None
    exporters = {s: _exporter(s, protocol) for s, protocol in protocols.items()}

    resource = _resource(service_version)
    telemetry = Telemetry(resource=resource)
    if sampling is not None:
        tp = _tracer_provider(resource, sampling[0])
        tp.add_span_processor(BatchSpanProcessor(exporters["traces"]()))
        telemetry.tracer_provider = tp
    if "logs" in exporters:
        lp = LoggerProvider(resource=resource, shutdown_on_exit=False)
        lp.add_log_record_processor(BatchLogRecordProcessor(exporters["logs"]()))
        telemetry.logger_provider = lp
    if "metrics" in exporters:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        reader = PeriodicExportingMetricReader(exporters["metrics"]())
        telemetry.meter_provider = MeterProvider(
            resource=resource, metric_readers=[reader], shutdown_on_exit=False
        )
    # the SDK's own exit hooks are unbounded against a collector that is down
    atexit.register(telemetry.shutdown)
    if set_global:
        _install_globals(telemetry)
    logger.info(
        "OpenTelemetry export on: %s%s",
        ", ".join(
            f"{s} over {protocol} to {otel.destination(s, env)}"
            for s, protocol in protocols.items()
        ),
        f"; traces sampled by {sampling[1]} (admin actions always)" if sampling is not None else "",
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
