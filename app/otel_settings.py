"""The ``OTEL_*`` settings the service's telemetry reads, checked before
anything is built (:func:`app.telemetry.setup_telemetry`).

The SDK and its exporters take almost anything: a value they cannot use is
replaced by a default with a warning (a sampler name they do not know: every
trace sampled; a timeout that is no number: 10 s; an unknown compression:
none), skipped (a header or resource attribute that is no ``name=value``),
kept until every export fails with it (an endpoint without ``http://``, a
certificate file that does not exist), or raised as a bare ``ValueError``
from deep in a constructor (a batch size above the queue size). Here each
one is a :class:`~kvoffload.errors.ConfigError` that names the variable and
says what it takes. A signal that is not exported is not asked about.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

from kvoffload.errors import ConfigError

__all__ = [
    "DEFAULT_PROTOCOL",
    "PROTOCOLS",
    "check",
    "destination",
    "endpoint",
    "env",
    "exported",
    "protocol",
    "sampler",
]

DEFAULT_PROTOCOL = "http/protobuf"
#: OTLP protocols: the exporter package of each (opentelemetry.exporter.otlp.proto.*)
PROTOCOLS = {"http/protobuf": "http", "grpc": "grpc"}

#: OTEL_TRACES_SAMPLER's values (the SDK's; it took any other name for
#: parentbased_always_on, every step traced)
_SAMPLERS = {
    "always_on": ALWAYS_ON,
    "always_off": ALWAYS_OFF,
    "parentbased_always_on": ParentBased(ALWAYS_ON),
    "parentbased_always_off": ParentBased(ALWAYS_OFF),
    "traceidratio": None,
    "parentbased_traceidratio": None,
}

#: the batch processors' integer settings (OTEL_BSP_* for spans, OTEL_BLRP_*
#: for log records): the least value, what it counts, the SDK's default
_BATCH = {
    "SCHEDULE_DELAY": (1, "milliseconds between exports", 5000),
    "EXPORT_TIMEOUT": (0, "milliseconds an export may take", 30000),
    "MAX_QUEUE_SIZE": (1, "records queued for export", 2048),
    "MAX_EXPORT_BATCH_SIZE": (1, "records per export, at most the queue size", 512),
}
_BATCH_PREFIX = {"traces": "OTEL_BSP_", "logs": "OTEL_BLRP_"}

#: OTEL_EXPORTER_OTLP_*COMPRESSION's values, by protocol (the gRPC exporter
#: raises for any but gzip; left unset, neither compresses)
_COMPRESSIONS = {"http/protobuf": ("gzip", "deflate", "none"), "grpc": ("gzip",)}


def env(environ: Mapping[str, str], name: str) -> str:
    """The variable's value, stripped ('' when unset)."""
    return environ.get(name, "").strip()


def _exporter_variable(
    signal: str, what: str, environ: Mapping[str, str]
) -> tuple[str, str] | None:
    """(variable, value) of the exporter setting ``what`` for ``signal``: its
    own variable (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``), else the common one
    (``OTEL_EXPORTER_OTLP_TIMEOUT``); ``None`` when neither is set."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_{what}", f"OTEL_EXPORTER_OTLP_{what}"):
        if value := env(environ, name):
            return name, value
    return None


def endpoint(signal: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, value) of the OTLP endpoint set for ``signal``; ``None``
    when none is."""
    return _exporter_variable(signal, "ENDPOINT", os.environ if environ is None else environ)


def exported(signal: str, environ: Mapping[str, str]) -> bool:
    """Whether ``signal`` is exported: an endpoint is set for it and its
    ``OTEL_{SIGNAL}_EXPORTER`` is ``otlp`` (the default), not ``none``.
    :class:`ConfigError` for another exporter (a comma-separated list
    included): kvoffload exports over OTLP only."""
    if endpoint(signal, environ) is None:
        return False
    name = f"OTEL_{signal.upper()}_EXPORTER"
    value = env(environ, name)
    names = {n.strip().lower() for n in value.split(",") if n.strip()} or {"otlp"}
    if names == {"none"}:
        return False
    if names != {"otlp"}:
        raise ConfigError(
            f"{name}={value!r} is not an exporter kvoffload has: 'otlp' (the default, to "
            f"the endpoint set) or 'none' (no {signal})"
        )
    return True


def destination(signal: str, environ: Mapping[str, str]) -> str:
    """Where ``signal`` goes, for a log line: its endpoint's scheme, host and
    port only (no user, path or query, which may carry credentials)."""
    setting = endpoint(signal, environ)
    if setting is None:
        return "nowhere"
    url = urlsplit(setting[1])
    port = f":{url.port}" if url.port else ""
    return f"{url.scheme}://{url.hostname}{port}"


def protocol(signal: str, environ: Mapping[str, str]) -> str:
    """The OTLP protocol ``signal`` is exported over: its own variable, else
    the common one, else HTTP/protobuf. :class:`ConfigError` for another."""
    setting = _exporter_variable(signal, "PROTOCOL", environ)
    if setting is None:
        return DEFAULT_PROTOCOL
    name, value = setting
    if value not in PROTOCOLS:
        raise ConfigError(
            f"{name}={value!r} is not a protocol kvoffload exports {signal} over: use "
            "'http/protobuf' (the default; a collector's OTLP/HTTP port, usually 4318) "
            "or 'grpc' (its OTLP/gRPC port, usually 4317)"
        )
    return value


def sampler(environ: Mapping[str, str], default_ratio: float) -> tuple[Sampler, str]:
    """The sampler OTEL_TRACES_SAMPLER(_ARG) name, or the default ratio
    (parent-based) when unset, and its name in a few words. :class:`ConfigError`
    for a name the SDK does not know or a ratio that is no number from 0 to 1,
    where the SDK would warn and sample every trace."""
    raw = env(environ, "OTEL_TRACES_SAMPLER")
    if not raw:
        return (
            ParentBased(TraceIdRatioBased(default_ratio)),
            f"parentbased_traceidratio {default_ratio:g}, the default",
        )
    name = raw.lower()  # as the SDK reads it
    if name not in _SAMPLERS:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER={raw!r} is not a sampler kvoffload can use: one of "
            f"{', '.join(_SAMPLERS)} (unset: parentbased_traceidratio at {default_ratio:g})"
        )
    fixed = _SAMPLERS[name]
    if fixed is not None:
        return fixed, name
    arg = env(environ, "OTEL_TRACES_SAMPLER_ARG")
    ratio = _number(arg) if arg else 1.0  # the specification's default
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a sampling ratio for {name}: a number "
            "from 0 to 1 (0.01: one trace in a hundred)"
        )
    ratio_sampler = TraceIdRatioBased(ratio)
    chosen = ParentBased(ratio_sampler) if name.startswith("parentbased_") else ratio_sampler
    return chosen, f"{name} {ratio:g}"


def check(protocols: Mapping[str, str], environ: Mapping[str, str]) -> None:
    """:class:`ConfigError` for the first setting of the exported signals
    (``protocols``: each one's protocol) that the SDK or an exporter would not
    use as given (see the module doc)."""
    for signal, over in protocols.items():
        _check_endpoint(signal, environ)
        _check_exporter(signal, over, environ)
        if signal in _BATCH_PREFIX:
            _check_batch(_BATCH_PREFIX[signal], environ)
    if "metrics" in protocols:
        _check_metric_reader(environ)
    if protocols:
        _check_pairs(
            "OTEL_RESOURCE_ATTRIBUTES", env(environ, "OTEL_RESOURCE_ATTRIBUTES"), show=True
        )


def _number(raw: str) -> float:
    """``float(raw)``, NaN for what is no number (NaN fails every range)."""
    try:
        return float(raw)
    except ValueError:
        return math.nan


def _check_endpoint(signal: str, environ: Mapping[str, str]) -> None:
    # the exporters take anything and fail at every export (localhost:4318
    # over HTTP: "no connection adapters"; over gRPC, a TLS channel to it)
    setting = endpoint(signal, environ)
    if setting is None:
        return
    name, value = setting
    url = urlsplit(value)
    try:
        # .port raises for a port that is no number (or out of range)
        ok = url.scheme in ("http", "https") and bool(url.hostname) and url.port != 0
    except ValueError:
        ok = False
    if not ok:
        # what comes before an '@' may be credentials (user:token@host)
        shown = "***@" + value.rpartition("@")[2] if "@" in value else value
        raise ConfigError(
            f"{name}={shown!r} is not an http:// or https:// URL with a host: write "
            "http://HOST:PORT for a collector without TLS, https://HOST:PORT with TLS"
        )


def _check_exporter(signal: str, over: str, environ: Mapping[str, str]) -> None:
    """The exporter's timeout, compression, headers and TLS files."""
    if setting := _exporter_variable(signal, "TIMEOUT", environ):
        name, value = setting
        # seconds, as the Python exporters read it (the specification says ms)
        if not 0.0 <= _number(value) < math.inf:
            raise ConfigError(
                f"{name}={value!r} is not a timeout: a number of seconds, 0 or more "
                "(the Python exporters read seconds; default 10)"
            )
    if setting := _exporter_variable(signal, "COMPRESSION", environ):
        name, value = setting
        allowed = _COMPRESSIONS[over]
        if value.lower() not in allowed:
            raise ConfigError(
                f"{name}={value!r} is not a compression the {over} exporter has: "
                f"{' or '.join(allowed)}{'' if over != 'grpc' else ', or leave it unset'}"
            )
    if setting := _exporter_variable(signal, "HEADERS", environ):
        _check_pairs(*setting, show=False)  # headers carry credentials
    for what in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        if setting := _exporter_variable(signal, what, environ):
            name, value = setting
            if not os.path.isfile(value):
                raise ConfigError(f"{name}={value!r} is not a file: give the path of a PEM file")


def _check_pairs(name: str, value: str, *, show: bool) -> None:
    """A comma-separated list of ``name=value`` (headers, resource
    attributes): the SDK skips an item that is not one, with a warning."""
    items = [item.strip() for item in value.split(",")]
    for i, item in enumerate(items, 1):
        key, equals, _ = item.partition("=")
        if item and not (equals and key.strip()):
            what = repr(item) if show else "(its text is not shown: headers carry credentials)"
            raise ConfigError(
                f"{name}: item {i} of {len(items)} is not name=value {what}; "
                "write name=value pairs separated by commas"
            )


def _check_batch(prefix: str, environ: Mapping[str, str]) -> None:
    values: dict[str, int] = {}
    for suffix, (least, what, default) in _BATCH.items():
        name = prefix + suffix
        raw = env(environ, name)
        try:
            values[suffix] = int(raw) if raw else default
        except ValueError:
            values[suffix] = least - 1
        if values[suffix] < least:
            raise ConfigError(
                f"{name}={raw!r} is not a whole number of at least {least} "
                f"({what}; default {default})"
            )
    if values["MAX_EXPORT_BATCH_SIZE"] > values["MAX_QUEUE_SIZE"]:
        raise ConfigError(
            f"{prefix}MAX_EXPORT_BATCH_SIZE ({values['MAX_EXPORT_BATCH_SIZE']}) is more than "
            f"{prefix}MAX_QUEUE_SIZE ({values['MAX_QUEUE_SIZE']}): an export takes at most "
            "what the queue holds"
        )


def _check_metric_reader(environ: Mapping[str, str]) -> None:
    checks: list[tuple[str, Callable[[float], bool], str]] = [
        (
            "OTEL_METRIC_EXPORT_INTERVAL",
            lambda v: v > 0,
            "milliseconds between exports, more than 0 (inf: only at shutdown; default 60000)",
        ),
        (
            "OTEL_METRIC_EXPORT_TIMEOUT",
            lambda v: 0 <= v < math.inf,
            "milliseconds an export may take, 0 or more (default 30000)",
        ),
    ]
    for name, ok, what in checks:
        raw = env(environ, name)
        if raw and not ok(_number(raw)):
            raise ConfigError(f"{name}={raw!r} is not a number of {what}")
