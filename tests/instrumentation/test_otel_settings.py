"""app/otel_settings.py: every OTEL_* setting the SDK or an exporter would
replace by a default, skip, fail on at every export, or raise a bare
ValueError for is a ConfigError naming the variable, before anything is built
(the SDK's own behaviour for each case is in the comments)."""

from __future__ import annotations

import threading

import pytest

from app.telemetry import Telemetry, setup_telemetry
from kvoffload.errors import ConfigError

ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture
def otel_env(clean_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* but an endpoint that takes every signal."""
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    return clean_env


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        # the SDK: logs a traceback, then uses 5000
        (
            {"OTEL_BSP_SCHEDULE_DELAY": "abc"},
            "OTEL_BSP_SCHEDULE_DELAY='abc' is not a whole number of at least 1 "
            "(milliseconds between exports; default 5000)",
        ),
        # the SDK: a bare ValueError out of BatchSpanProcessor (serve: a traceback)
        (
            {"OTEL_BSP_MAX_QUEUE_SIZE": "-5"},
            "OTEL_BSP_MAX_QUEUE_SIZE='-5' is not a whole number of at least 1 "
            "(records queued for export; default 2048)",
        ),
        (
            {"OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "0"},
            "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE='0' is not a whole number of at least 1",
        ),
        (
            {"OTEL_BLRP_EXPORT_TIMEOUT": "1.5"},
            "OTEL_BLRP_EXPORT_TIMEOUT='1.5' is not a whole number of at least 0",
        ),
        (
            {"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "200"},
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE (200) is more than OTEL_BSP_MAX_QUEUE_SIZE (100)",
        ),
        (
            {"OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "4096"},  # against the default queue, 2048
            "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE (4096) is more than OTEL_BLRP_MAX_QUEUE_SIZE (2048)",
        ),
        # the SDK: a warning, then 60000 ms
        (
            {"OTEL_METRIC_EXPORT_INTERVAL": "abc"},
            "OTEL_METRIC_EXPORT_INTERVAL='abc' is not a number of milliseconds between exports",
        ),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "0"}, "OTEL_METRIC_EXPORT_INTERVAL='0' is not"),
        ({"OTEL_METRIC_EXPORT_TIMEOUT": "-1"}, "OTEL_METRIC_EXPORT_TIMEOUT='-1' is not"),
        # the HTTP exporter: a warning, then 10 s; the gRPC one: a bare ValueError
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "10s"},
            "OTEL_EXPORTER_OTLP_TIMEOUT='10s' is not a timeout: a number of seconds",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "inf"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='inf' is not a timeout",
        ),
        # the HTTP exporter: a warning, then no compression
        (
            {"OTEL_EXPORTER_OTLP_LOGS_COMPRESSION": "zstd"},
            "OTEL_EXPORTER_OTLP_LOGS_COMPRESSION='zstd' is not a compression the "
            "http/protobuf exporter has: gzip or deflate or none",
        ),
        # the gRPC exporter raises for anything but gzip, 'none' included
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_COMPRESSION": "none"},
            "OTEL_EXPORTER_OTLP_COMPRESSION='none' is not a compression the grpc exporter "
            "has: gzip, or leave it unset",
        ),
        # the SDK: a warning, and the item is not sent
        (
            {"OTEL_EXPORTER_OTLP_HEADERS": "api-key=s3cret,no-equals-sign"},
            "OTEL_EXPORTER_OTLP_HEADERS: item 2 of 2 is not name=value (its text is not "
            "shown: headers carry credentials)",
        ),
        (
            {"OTEL_EXPORTER_OTLP_METRICS_HEADERS": "=s3cret"},
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS: item 1 of 1 is not name=value",
        ),
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team"},
            "OTEL_RESOURCE_ATTRIBUTES: item 2 of 2 is not name=value 'team'",
        ),
        # the exporters: every export fails
        (
            {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"},
            "OTEL_EXPORTER_OTLP_CERTIFICATE='/nonexistent/ca.pem' is not a file",
        ),
        (
            {"OTEL_EXPORTER_OTLP_LOGS_CLIENT_KEY": "/nonexistent/key.pem"},
            "OTEL_EXPORTER_OTLP_LOGS_CLIENT_KEY='/nonexistent/key.pem' is not a file",
        ),
    ],
)
def test_a_setting_the_sdk_would_not_use_as_given_is_an_error(
    otel_env: pytest.MonkeyPatch, settings: dict[str, str], message: str
) -> None:
    for name, value in settings.items():
        otel_env.setenv(name, value)
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError) as err:
        setup_telemetry()
    assert str(err.value).startswith(message), str(err.value)
    assert "s3cret" not in str(err.value)
    assert {t.ident for t in threading.enumerate()} <= threads_before  # nothing built


@pytest.mark.parametrize(
    "settings",
    [
        {
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_BSP_EXPORT_TIMEOUT": "0",
            "OTEL_BSP_MAX_QUEUE_SIZE": "64",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
            "OTEL_BLRP_MAX_QUEUE_SIZE": "10000",
        },
        {"OTEL_METRIC_EXPORT_INTERVAL": "inf", "OTEL_METRIC_EXPORT_TIMEOUT": "2500.5"},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "2.5", "OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP"},
        {"OTEL_EXPORTER_OTLP_HEADERS": "api-key=s3cret, x-tenant = a=b ,"},
        {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=kv"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"},
    ],
)
def test_settings_the_sdk_takes_as_given_build(
    otel_env: pytest.MonkeyPatch, settings: dict[str, str]
) -> None:
    for name, value in settings.items():
        otel_env.setenv(name, value)
    telemetry: Telemetry = setup_telemetry()
    try:
        assert telemetry.exporting
    finally:
        # nothing was recorded: shutdown sends at most an empty metrics export
        telemetry.shutdown(timeout_s=1)


def test_the_settings_of_a_signal_not_exported_are_not_checked(
    otel_env: pytest.MonkeyPatch,
) -> None:
    otel_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "-5")
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd")
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    otel_env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "abc")
    otel_env.setenv("OTEL_METRICS_EXPORTER", "none")
    telemetry = setup_telemetry()
    try:
        assert telemetry.logger_provider is not None and telemetry.tracer_provider is None
    finally:
        telemetry.shutdown(timeout_s=1)
