"""app/telemetry.py: OTLP export end to end into a local receiver, over HTTP and
over gRPC, configured only through OTEL_* variables; silence when nothing is
configured; a clear error for a protocol it cannot export over."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.telemetry import DEFAULT_SAMPLING_RATIO, Telemetry, setup_telemetry
from kvoffload.errors import ConfigError
from kvoffload.runtime.commands import CommandResult

from .otlp_receiver import (
    GRPC_METHODS,
    Receiver,
    attrs,
    running_grpc_receiver,
    running_receiver,
)
from .test_tracing import _one_step

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as r:
        yield r


#: each OTLP protocol: its receiver, and the path (HTTP) or method (gRPC) of each
#: signal's export
PROTOCOLS = {
    "http/protobuf": (
        running_receiver,
        {"traces": "/v1/traces", "logs": "/v1/logs", "metrics": "/v1/metrics"},
    ),
    "grpc": (running_grpc_receiver, GRPC_METHODS),
}
Over = tuple[Receiver, dict[str, str]]


@pytest.fixture(params=sorted(PROTOCOLS))
def over(request: pytest.FixtureRequest, clean_env: pytest.MonkeyPatch) -> Iterator[Over]:
    """A receiver for one protocol, OTEL_EXPORTER_OTLP_PROTOCOL naming it, and
    where each signal's export arrives."""
    start, paths = PROTOCOLS[request.param]
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", request.param)
    with start() as r:
        yield r, paths


@pytest.fixture
def telemetry_teardown() -> Iterator[list[Telemetry]]:
    made: list[Telemetry] = []
    yield made
    for t in made:
        t.shutdown()


def test_telemetry_exports_spans_and_logs_over_otlp(
    over: Over, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    receiver, path = over
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
    clean_env.setenv("OTEL_SERVICE_NAME", "kvoffload-e2e")
    telemetry = setup_telemetry(service_version="9.9.9")
    telemetry_teardown.append(telemetry)
    assert telemetry.exporting
    obs = telemetry.tracing_observer()
    _one_step(obs)
    obs.command_applied(CommandResult("switch_policy", 1, "arc", 2, {"from": "lru"}))
    telemetry.shutdown()

    # metrics go too (an empty export at shutdown: no instruments here)
    assert {path["traces"], path["logs"]} <= set(receiver.paths)
    assert set(receiver.paths) <= set(path.values())
    spans = receiver.spans()
    assert sorted(s.name for s in spans) == [
        "kvoffload.request",
        "kvoffload.step",
        "kvoffload.transfer",
        "kvoffload.transfer",
    ]
    (step,) = [s for s in spans if s.name == "kvoffload.step"]
    assert attrs(step.attributes) == {"kvoffload.step": 1, "kvoffload.step.requests": 1}
    transfers = {
        attrs(s.attributes)["kvoffload.transfer.direction"]: s
        for s in spans
        if s.name == "kvoffload.transfer"
    }
    assert attrs(transfers["store"].attributes) == {
        "kvoffload.transfer.job_id": 7,
        "kvoffload.transfer.direction": "store",
        "kvoffload.transfer.blocks": 4,
        "kvoffload.transfer.bytes": 65536,
        "kvoffload.transfer.outcome": "ok",
    }
    assert transfers["store"].parent_span_id == step.span_id
    assert transfers["store"].trace_id == step.trace_id
    (req,) = [s for s in spans if s.name == "kvoffload.request"]
    assert attrs(req.attributes)["gen_ai.usage.cache_read.input_tokens"] == 192

    resource = attrs(receiver.traces[0].resource_spans[0].resource.attributes)
    assert resource["service.name"] == "kvoffload-e2e"
    assert resource["service.version"] == "9.9.9"
    assert len(str(resource["service.instance.id"])) == 36

    records = receiver.log_records()
    by_event = {r.event_name: r for r in records}
    assert set(by_event) == {"kvoffload.eviction", "kvoffload.policy_switch"}
    eviction = by_event["kvoffload.eviction"]
    assert eviction.trace_id == step.trace_id and eviction.span_id == step.span_id
    assert attrs(eviction.attributes)["kvoffload.eviction.blocks"] == 5
    assert attrs(by_event["kvoffload.policy_switch"].attributes)["kvoffload.policy"] == "arc"


def test_telemetry_signal_endpoint_and_exporter_none(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url + "/v1/traces")
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
    telemetry = setup_telemetry()
    telemetry_teardown.append(telemetry)
    assert telemetry.tracer_provider is not None and telemetry.logger_provider is None
    _one_step(telemetry.tracing_observer())
    telemetry.shutdown()
    assert receiver.paths == ["/v1/traces"]

    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not setup_telemetry().exporting


def test_telemetry_default_resource_and_sampler(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    a = setup_telemetry()
    b = setup_telemetry()
    telemetry_teardown.extend([a, b])
    assert a.tracer_provider is not None and a.resource is not None and b.resource is not None
    assert a.resource.attributes["service.name"] == "kvoffload"
    instance = a.resource.attributes["service.instance.id"]
    assert instance == b.resource.attributes["service.instance.id"]  # one id per process
    # admin actions are always sampled; everything else by the parent-based ratio
    description = a.tracer_provider.sampler.get_description()
    assert description.startswith("AdminAlwaysSampler{ParentBased")
    assert str(DEFAULT_SAMPLING_RATIO) in description

    clean_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,deployment.environment=t")
    c = setup_telemetry()
    telemetry_teardown.append(c)
    assert c.tracer_provider is not None and c.resource is not None
    assert "0.25" in c.tracer_provider.sampler.get_description()
    assert c.resource.attributes["service.name"] == "from-attrs"
    assert c.resource.attributes["deployment.environment"] == "t"


@pytest.mark.parametrize(
    ("sampler", "arg", "steps_sampled"),
    [
        (None, None, None),  # the default, 1%
        ("parentbased_traceidratio", "0.01", None),  # the default written out (issue 18)
        ("traceidratio", "0", 0),
        ("parentbased_always_off", None, 0),
        ("always_off", None, 0),
        ("always_on", None, 200),
    ],
)
def test_admin_spans_are_sampled_whatever_sampler_is_configured(
    receiver: Receiver,
    clean_env: pytest.MonkeyPatch,
    telemetry_teardown: list[Telemetry],
    sampler: str | None,
    arg: str | None,
    steps_sampled: int | None,
) -> None:
    # issue 18, defect 5: with OTEL_TRACES_SAMPLER set, the SDK's sampler was
    # taken as it was and admin spans were sampled at its ratio (11 of 1001)
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    if sampler is not None:
        clean_env.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    telemetry = setup_telemetry()
    telemetry_teardown.append(telemetry)
    assert telemetry.tracer_provider is not None
    admin = telemetry.tracer_provider.get_tracer("kvoffload.admin")
    engine = telemetry.tracer_provider.get_tracer("kvoffload")
    for _ in range(200):
        with admin.start_as_current_span("kvoffload.admin.switch_policy"):
            pass
        engine.start_span("kvoffload.step").end()
    telemetry.shutdown()
    names = [s.name for s in receiver.spans()]
    assert names.count("kvoffload.admin.switch_policy") == 200
    if steps_sampled is not None:  # the configured sampler still decides the rest
        assert names.count("kvoffload.step") == steps_sampled
    else:
        assert names.count("kvoffload.step") < 50


def test_telemetry_slow_collector_does_not_block_the_engine_thread(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    clean_env.setenv("OTEL_BLRP_SCHEDULE_DELAY", "10")
    receiver.open.clear()  # the collector hangs
    telemetry = setup_telemetry()
    telemetry_teardown.append(telemetry)
    obs = telemetry.tracing_observer()
    _one_step(obs, 1)
    assert receiver.first_request.wait(10), "nothing was exported"
    for step in range(2, 200):  # keeps producing while the export is stuck
        _one_step(obs, step)
    assert not receiver.open.is_set() and not receiver.traces  # still stuck
    receiver.open.set()
    telemetry.shutdown()
    assert len([s for s in receiver.spans() if s.name == "kvoffload.step"]) == 199


def test_shutdown_gives_up_on_a_hung_collector_at_its_deadline(
    receiver: Receiver,
    clean_env: pytest.MonkeyPatch,
    telemetry_teardown: list[Telemetry],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the SDK's exporters wait out their own timeout (600 s here), retrying
    # with back-off, and ignore the flush's: a stop took 13 s with a
    # collector that was down, and would take 10 minutes here
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "600")
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
    receiver.open.clear()  # the collector takes the request and never answers
    try:
        telemetry = setup_telemetry()
        telemetry_teardown.append(telemetry)
        _one_step(telemetry.tracing_observer())
        flushed: list[bool] = []
        flusher = threading.Thread(target=lambda: flushed.append(telemetry.force_flush(0.5)))
        flusher.start()
        flusher.join(120)
        assert flushed == [False], "force_flush waited for the hung collector"
        outcome: list[bool] = []
        stopper = threading.Thread(target=lambda: outcome.append(telemetry.shutdown(0.5)))
        with caplog.at_level(logging.WARNING, logger="app.telemetry"):
            stopper.start()
            stopper.join(120)
        assert outcome == [False], "shutdown waited for the hung collector"
        assert "telemetry export did not finish within 0.5 s" in caplog.text
        assert telemetry.shutdown() is True  # idempotent: nothing left to do
    finally:
        receiver.open.set()
    # the collector answers now: the flushes given up on end, and with them the
    # exporters (left running, their retries' jitter would draw from `random`
    # under later tests' Hypothesis draws in this worker)
    for thread in threading.enumerate():
        if thread.name == "kvoffload-otel-flush":
            thread.join(60)
            assert not thread.is_alive(), "the given-up flush never ended"


def test_a_process_that_never_calls_shutdown_still_exits_promptly(receiver: Receiver) -> None:
    # the SDK's exit hooks flushed without a bound; setup_telemetry's own
    # hook is Telemetry.shutdown (5 s)
    program = (
        "from app.telemetry import setup_telemetry\n"
        "from tests.instrumentation.test_tracing import _one_step\n"
        "_one_step(setup_telemetry().tracing_observer())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "600",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    receiver.open.clear()
    try:
        done = subprocess.run(
            [sys.executable, "-c", program],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        receiver.open.set()
    assert done.returncode == 0, done.stderr
    assert receiver.first_request.is_set()  # it did try to export
    assert "telemetry export did not finish within 5.0 s" in done.stderr


def test_telemetry_without_endpoint_exports_and_logs_nothing(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    threads_before = {t.ident for t in threading.enumerate()}
    clean_env.setenv("OTEL_SERVICE_NAME", "x")  # not an endpoint
    telemetry = setup_telemetry()
    assert not telemetry.exporting
    assert telemetry.tracer_provider is None and telemetry.logger_provider is None
    obs = telemetry.tracing_observer()
    for step in range(1, 20):
        _one_step(obs, step)
    obs.command_applied(CommandResult("switch_policy", 19, "arc", 2, {"from": "lru"}))
    obs.close()
    telemetry.shutdown()
    telemetry.shutdown()
    time.sleep(0.05)
    assert {t.ident for t in threading.enumerate()} <= threads_before, "an export thread started"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_telemetry_sdk_disabled_exports_nothing(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = setup_telemetry()
    assert not telemetry.exporting
    _one_step(telemetry.tracing_observer())
    telemetry.shutdown()
    assert receiver.paths == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("exporter", ["zipkin", "otlp,console", "console"])
def test_an_exporter_other_than_otlp_is_an_error(
    clean_env: pytest.MonkeyPatch, exporter: str
) -> None:
    # it was a warning and the signal off: an operator who asked for zipkin
    # or the console got nothing, and "otlp,console" silently no console
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv("OTEL_TRACES_EXPORTER", exporter)
    with pytest.raises(ConfigError) as err:
        setup_telemetry()
    assert str(err.value) == (
        f"OTEL_TRACES_EXPORTER={exporter!r} is not an exporter kvoffload has: 'otlp' (the "
        "default, to the endpoint set) or 'none' (no traces)"
    )
    # with no endpoint nothing is exported, and nothing asked
    clean_env.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert not setup_telemetry().exporting


def test_each_signal_may_name_its_own_protocol(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    # traces over gRPC to one collector, logs over HTTP to another (the
    # signal's variable wins over the common one), metrics off
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    clean_env.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", receiver.url + "/v1/logs")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
    with running_grpc_receiver() as grpc_receiver:
        clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", grpc_receiver.url)
        telemetry = setup_telemetry()
        telemetry_teardown.append(telemetry)
        assert telemetry.meter_provider is None
        _one_step(telemetry.tracing_observer())
        assert telemetry.shutdown()
    assert set(grpc_receiver.paths) == {GRPC_METHODS["traces"]}
    assert "kvoffload.step" in {s.name for s in grpc_receiver.spans()}
    assert set(receiver.paths) == {"/v1/logs"}
    assert receiver.log_records()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "GRPC"),
        ("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "thrift"),
    ],
)
def test_a_protocol_it_cannot_export_over_is_an_error(
    clean_env: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    # it used to be a warning, then OTLP/HTTP to what may be a gRPC port:
    # every export failing, long after start-up
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv(variable, value)
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError) as err:
        setup_telemetry()
    assert str(err.value).startswith(f"{variable}={value!r} is not a protocol")
    assert "'http/protobuf'" in str(err.value) and "'grpc'" in str(err.value)
    assert {t.ident for t in threading.enumerate()} <= threads_before  # nothing built
    # a signal that is not exported is not asked about
    clean_env.setenv("OTEL_LOGS_EXPORTER", "none")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    assert not setup_telemetry().exporting


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector:4318"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:43x8"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4318/v1/traces"),
    ],
)
def test_an_endpoint_that_is_no_http_url_is_an_error(
    clean_env: pytest.MonkeyPatch, protocol: str, variable: str, value: str
) -> None:
    # the exporters took it and failed at every export ("No connection
    # adapters were found for 'localhost:4318/v1/traces'" over HTTP, and a
    # shutdown that still said all was flushed)
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    clean_env.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        setup_telemetry()
    assert str(err.value) == (
        f"{variable}={value!r} is not an http:// or https:// URL with a host: write "
        "http://HOST:PORT for a collector without TLS, https://HOST:PORT with TLS"
    )


def test_the_credentials_of_a_bad_endpoint_are_not_shown(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "user:s3cret@collector:4318")
    with pytest.raises(ConfigError) as err:
        setup_telemetry()
    assert "s3cret" not in str(err.value)
    assert str(err.value).startswith("OTEL_EXPORTER_OTLP_ENDPOINT='***@collector:4318' is not")


def test_the_start_up_line_says_where_each_signal_goes_without_credentials(
    clean_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    telemetry_teardown: list[Telemetry],
) -> None:
    clean_env.setenv(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "https://user:s3cret@collector.example:4318/x?key=s3cret"
    )
    clean_env.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://logs.example:4318/v1/logs")
    clean_env.setenv("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "grpc")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    with caplog.at_level(logging.INFO, logger="app.telemetry"):
        telemetry_teardown.append(setup_telemetry())
    (line,) = [r.getMessage() for r in caplog.records if "export on" in r.getMessage()]
    assert line == (
        "OpenTelemetry export on: traces over http/protobuf to https://collector.example:4318, "
        "logs over grpc to http://logs.example:4318; traces sampled by "
        "parentbased_traceidratio 0.01, the default (admin actions always)"
    )


def test_an_endpoint_is_checked_only_for_a_signal_it_exports(
    clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector.example:4318")
    clean_env.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "not a url")
    clean_env.setenv("OTEL_LOGS_EXPORTER", "none")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")  # no export at shutdown either
    telemetry = setup_telemetry()  # builds; connects to nothing until an export
    telemetry_teardown.append(telemetry)
    assert telemetry.tracer_provider is not None and telemetry.logger_provider is None


@pytest.mark.parametrize(
    ("sampler", "arg", "message"),
    [
        (
            "nonsense",
            None,
            "OTEL_TRACES_SAMPLER='nonsense' is not a sampler kvoffload can use: one of "
            "always_on, always_off, parentbased_always_on, parentbased_always_off, "
            "traceidratio, parentbased_traceidratio (unset: parentbased_traceidratio at 0.01)",
        ),
        ("traceidratio", "abc", "OTEL_TRACES_SAMPLER_ARG='abc' is not a sampling ratio"),
        ("traceidratio", "2", "OTEL_TRACES_SAMPLER_ARG='2' is not a sampling ratio"),
        ("parentbased_traceidratio", "-0.1", "OTEL_TRACES_SAMPLER_ARG='-0.1' is not a"),
        ("parentbased_traceidratio", "nan", "OTEL_TRACES_SAMPLER_ARG='nan' is not a"),
    ],
)
def test_a_sampler_the_sdk_would_replace_by_always_on_is_an_error(
    clean_env: pytest.MonkeyPatch, sampler: str, arg: str | None, message: str
) -> None:
    # the SDK warned and sampled every trace: hundreds of step spans a second
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError) as err:
        setup_telemetry()
    assert str(err.value).startswith(message)
    assert {t.ident for t in threading.enumerate()} <= threads_before  # nothing built
    # traces not exported: the sampler is not asked about
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    clean_env.setenv("OTEL_LOGS_EXPORTER", "none")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    assert not setup_telemetry().exporting


@pytest.mark.parametrize(
    ("sampler", "arg", "description"),
    [
        ("TraceIdRatio", None, "TraceIdRatioBased{1.0}"),  # the specification's default
        ("traceidratio", " 0.5 ", "TraceIdRatioBased{0.5}"),
        ("parentbased_always_off", "abc", "ParentBased{root:AlwaysOffSampler"),  # arg unused
        ("ALWAYS_ON", None, "AlwaysOnSampler"),
    ],
)
def test_samplers_read_as_the_sdk_reads_them(
    clean_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    telemetry_teardown: list[Telemetry],
    sampler: str,
    arg: str | None,
    description: str,
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    clean_env.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    telemetry = setup_telemetry()
    telemetry_teardown.append(telemetry)
    assert telemetry.tracer_provider is not None
    got = telemetry.tracer_provider.sampler.get_description()
    assert got.startswith(f"AdminAlwaysSampler{{{description}"), got
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_grpc_without_its_exporter_names_the_extra(clean_env: pytest.MonkeyPatch) -> None:
    package = "opentelemetry.exporter.otlp.proto.grpc"
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        clean_env.delitem(sys.modules, name)
    clean_env.setitem(sys.modules, package, None)  # as if not installed
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ConfigError, match=r"pip install 'kvoffload\[otlp-grpc\]'"):
        setup_telemetry()


def test_telemetry_does_not_set_global_providers(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    from opentelemetry import _logs, trace

    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    before = (trace.get_tracer_provider(), _logs.get_logger_provider())
    telemetry_teardown.append(setup_telemetry())
    assert (trace.get_tracer_provider(), _logs.get_logger_provider()) == before


def test_telemetry_exports_the_metric_catalogue_over_otlp(
    over: Over, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    from prometheus_client import CollectorRegistry

    from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge
    from kvoffload.instrumentation.prometheus import KVOffloadCollector

    from .conftest import make_manager, store

    receiver, path = over
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    telemetry = setup_telemetry()
    telemetry_teardown.append(telemetry)
    assert telemetry.meter_provider is not None
    manager = make_manager("lru", capacity=8)
    store(manager, range(5))
    registry = CollectorRegistry()
    KVOffloadCollector(manager.stats, registry=registry)
    OTelMetricsBridge(telemetry.meter_provider, registry)
    telemetry.shutdown()  # the periodic reader exports once more on shutdown

    assert path["metrics"] in receiver.paths
    _, points = receiver.metric_exports()[-1]
    stored = {labels["outcome"]: value for labels, value in points["kvoffload_store_blocks"]}
    assert stored["stored"] == 5
    assert points["kvoffload_used_blocks"] == [({"medium": "CPU"}, 5)]


def test_metrics_export_can_be_turned_off(
    receiver: Receiver, clean_env: pytest.MonkeyPatch, telemetry_teardown: list[Telemetry]
) -> None:
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry()
    telemetry_teardown.append(telemetry)
    assert telemetry.meter_provider is None and telemetry.tracer_provider is not None
