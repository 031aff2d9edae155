"""The embedded admin server: started in this process for a HostedManager that
a host thread drives, over real HTTP on loopback; and the docs' example."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_support import ADMIN, ADMIN_HEADERS, READ_HEADERS, small_settings
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app import AdminServer, StartupError, start_admin_server
from kvoffload import BlockHash, CPUBackend, PolicyOffloadingManager
from kvoffload.instrumentation import TracingObserver
from kvoffload.runtime import HostedManager, TransferRecord

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture
def hosted() -> Iterator[tuple[HostedManager, AdminServer]]:
    manager = PolicyOffloadingManager(
        CPUBackend(block_size=16, num_blocks=32), policy="lru", enable_events=True
    )
    target = HostedManager(manager)
    server = start_admin_server(target, small_settings(port=0))
    try:
        yield target, server
    finally:
        server.stop()
        assert not server.running


def drive(target: HostedManager, stop: threading.Event) -> None:
    """The host's scheduler: stores and loads, with idle gaps."""
    i = 0
    while not stop.is_set():
        chain = [BlockHash(f"b{i % 50 + j}".encode()) for j in range(4)]
        hit = target.lookup(chain)
        if hit:
            target.prepare_load(chain[:hit])
            target.complete_load(chain[:hit])
        out = target.prepare_store(chain[hit:])
        if out is not None:
            target.complete_store(out.block_hashes_to_store)
        i += 1
        if i % 100 == 0:
            time.sleep(0.01)


def test_every_route_serves_a_hosted_manager(hosted: tuple[HostedManager, AdminServer]) -> None:
    target, server = hosted
    stop = threading.Event()
    host = threading.Thread(target=drive, args=(target, stop))
    host.start()
    try:
        with httpx.Client(base_url=server.url, headers=ADMIN_HEADERS, timeout=10.0) as http:
            assert http.get("/livez").status_code == 200
            assert http.get("/readyz").json()["state"] == "running"
            switched = http.put("/v1/policy", json={"policy": "arc", "expected_version": 1})
            assert switched.status_code == 200, switched.text
            assert switched.json()["version"] == 2
            view = http.get("/v1/cache").json()
            assert view["policy"] == "arc" and view["arc"] is not None
            assert view["workload"].startswith("hosted")
            assert http.get("/v1/policy").json()["version"] == 2
            valid = http.post("/v1/policy:validate", json={"policy": "kvarc"})
            assert valid.status_code == 200
            assert http.get("/v1/events?limit=3").json()["events"]
            with http.stream("GET", "/v1/events/stream?after_seq=0&limit=2") as r:
                assert r.status_code == 200
                ids = [line for line in r.iter_lines() if line.startswith("id: ")]
            assert len(ids) == 2
            assert http.post("/v1/events:drain", json={"limit": 5}).status_code == 200
            metrics = http.get("/metrics").text
            assert 'kvoffload_policy_info{policy="arc"} 1.0' in metrics
            assert "kvoffload_config_info" in metrics
            for action in ("pause", "resume"):
                r = http.post(f"/v1/runtime:{action}")
                assert r.status_code == 409
                assert r.json()["error"]["code"] == "not_supported"
            reset = http.post("/v1/cache:reset", json={"confirm": True})
            assert reset.status_code == 200, reset.text
    finally:
        stop.set()
        host.join(10)


def test_a_command_to_an_idle_host_is_applied_at_once(
    hosted: tuple[HostedManager, AdminServer],
) -> None:
    # Nothing calls the manager: the switch must not wait for a next call.
    _, server = hosted
    r = httpx.put(
        f"{server.url}/v1/policy", json={"policy": "kvarc"}, headers=ADMIN_HEADERS, timeout=5.0
    )
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/v1/cache", headers=READ_HEADERS).json()["policy"] == "kvarc"


def test_commands_to_a_hosted_manager_are_log_records_in_the_admin_spans_trace() -> None:
    """Given a TracingObserver, the hosted manager logs each command that took
    effect as the runtime's engine does: a switch to the policy in use (which
    changes nothing) is not logged, and a command applied at once to an idle
    host is applied by the admin request's thread, inside its span."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logs = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    logger_provider = LoggerProvider(shutdown_on_exit=False)
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    manager = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=8), policy="lru")
    target = HostedManager(manager, observers=[TracingObserver(None, logger_provider)])
    server = start_admin_server(target, small_settings(port=0), tracer_provider=tracer_provider)
    try:
        with httpx.Client(base_url=server.url, headers=ADMIN_HEADERS, timeout=10.0) as http:
            for policy in ("arc", "arc"):
                assert http.put("/v1/policy", json={"policy": policy}).status_code == 200
            assert http.post("/v1/cache:reset", json={"confirm": True}).status_code == 200
    finally:
        server.stop()
    admin = [s for s in spans.get_finished_spans() if s.name.startswith("kvoffload.admin.")]
    records = [d.log_record for d in logs.get_finished_logs()]
    assert [(r.event_name, dict(r.attributes or {})) for r in records] == [
        (
            "kvoffload.policy_switch",
            {
                "kvoffload.command": "switch_policy",
                "kvoffload.step": 0,
                "kvoffload.policy": "arc",
                "kvoffload.policy.version": 2,
                "kvoffload.policy.previous": "lru",
            },
        ),
        (
            "kvoffload.command",
            {
                "kvoffload.command": "reset",
                "kvoffload.step": 0,
                "kvoffload.policy": "arc",
                "kvoffload.policy.version": 2,
            },
        ),
    ]
    switch, _, reset = admin
    assert switch.context is not None and reset.context is not None
    assert (switch.name, reset.name) == ("kvoffload.admin.switch_policy", "kvoffload.admin.reset")
    assert records[0].trace_id == switch.context.trace_id
    assert records[1].trace_id == reset.context.trace_id != switch.context.trace_id


def test_a_drain_shows_at_once_in_every_view_of_a_hosted_manager() -> None:
    # issue 18, defect 1: the event log's counts came from the published
    # snapshot, which a hosted manager refreshes only now and then (here: on
    # commands only), and both renderings were reused while it was the same
    manager = PolicyOffloadingManager(
        CPUBackend(block_size=16, num_blocks=8), policy="lru", enable_events=True
    )
    target = HostedManager(manager, snapshot_max_age=3600.0)
    for i in range(12):
        out = target.prepare_store([BlockHash(b"%d" % i)])
        assert out is not None
        target.complete_store(out.block_hashes_to_store)
    server = start_admin_server(target, small_settings(port=0))
    try:
        with httpx.Client(base_url=server.url, headers=ADMIN_HEADERS, timeout=10.0) as http:
            appended = http.get("/v1/cache").json()["events"]["appended"]
            assert http.get("/metrics").status_code == 200
            drained = http.post("/v1/events:drain", json={"limit": 5}).json()
            events = http.get("/v1/cache").json()["events"]
            assert (events["appended"], events["drained"]) == (appended, 5)
            assert events["buffered"] == drained["remaining"] == appended - 5
            metrics = http.get("/metrics").text
            assert "kvoffload_events_drained_total 5.0" in metrics
            assert f"kvoffload_events_buffered {appended - 5}.0" in metrics
    finally:
        server.stop()


def test_the_host_feeds_transfer_records_to_the_servers_observer(
    hosted: tuple[HostedManager, AdminServer],
) -> None:
    _, server = hosted
    server.prometheus.transfer_finished(TransferRecord(1, "store", 4, 4096, 0, 1_000_000, True))
    value = server.registry.get_sample_value(
        "kvoffload_transfer_bytes_total", {"direction": "store"}
    )
    assert value == 4096
    text = httpx.get(f"{server.url}/metrics", headers=READ_HEADERS).text
    assert 'kvoffload_transfer_bytes_total{direction="store"} 4096.0' in text


def test_a_bad_address_is_a_startup_error() -> None:
    manager = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=8))
    with pytest.raises(StartupError, match=r"cannot listen on no-such-host\.invalid"):
        start_admin_server(
            HostedManager(manager), small_settings(host="no-such-host.invalid", port=0)
        )


def test_stop_ends_live_streams(hosted: tuple[HostedManager, AdminServer]) -> None:
    _, server = hosted
    ended = threading.Event()

    def tail() -> None:
        with httpx.stream(
            "GET", f"{server.url}/v1/events/stream", headers=READ_HEADERS, timeout=30
        ) as r:
            for _ in r.iter_lines():
                pass
        ended.set()

    reader = threading.Thread(target=tail, daemon=True)
    reader.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    server.stop()
    assert ended.wait(5), "the stream did not end at stop()"
    assert not server.running
    assert time.monotonic() - t0 < 5


def test_the_docs_embedding_example_runs() -> None:
    text = DOCS.read_text()
    match = re.search(r"## Embedding the admin server\n.*?```python\n(.*?)```", text, re.S)
    assert match is not None, "docs/api.md lost its embedding example"
    done = subprocess.run(
        [sys.executable, "-c", match.group(1)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["arc", "1"]
    assert ADMIN not in done.stderr


class SlowKey:
    """A block hash whose hashing takes a while: the host's call holds the
    manager's lock that long."""

    def __hash__(self) -> int:
        time.sleep(1.0)
        return 1

    def __eq__(self, other: object) -> bool:
        return other is self


def test_a_command_that_timed_out_is_still_applied() -> None:
    # docs/api.md: 504 engine_timeout, "the command stays queued"
    manager = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=8), policy="lru")
    target = HostedManager(manager)
    server = start_admin_server(target, small_settings(port=0, command_timeout=0.2))
    try:
        busy = threading.Thread(target=target.lookup, args=([SlowKey()],))
        busy.start()
        time.sleep(0.1)  # the host's call holds the lock now
        r = httpx.put(
            f"{server.url}/v1/policy", json={"policy": "arc"}, headers=ADMIN_HEADERS, timeout=5
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "engine_timeout", r.text
        busy.join(5)
        got = httpx.get(f"{server.url}/v1/policy", headers=READ_HEADERS).json()
        assert (got["policy"], got["version"]) == ("arc", 2)
    finally:
        server.stop()


def test_event_routes_of_a_manager_without_events_are_409() -> None:
    # docs/api.md: 409 events_disabled, on every event route
    manager = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=8), policy="lru")
    server = start_admin_server(HostedManager(manager), small_settings(port=0))
    try:
        answers = [
            httpx.get(f"{server.url}/v1/events", headers=READ_HEADERS),
            httpx.get(f"{server.url}/v1/events/stream", headers=READ_HEADERS),
            httpx.post(f"{server.url}/v1/events:drain", json={}, headers=ADMIN_HEADERS),
        ]
        for r in answers:
            assert r.status_code == 409 and r.json()["error"]["code"] == "events_disabled", r.text
    finally:
        server.stop()
