"""kvoffload.vllm.admin without vLLM: the manager vLLM's scheduler would
drive with ``admin_port``, its event log shared with vLLM's take_events, and
the server's life, over real HTTP on loopback. Inside a real engine:
tests/vllm_engine/test_admin.py."""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator

import httpx
import pytest
from instrumentation.otlp_receiver import attrs, running_receiver

from kvoffload import BlockHash, ConfigError, CPUBackend, PolicyOffloadingManager
from kvoffload.runtime import EngineStoppedError, TransferRecord
from kvoffload.vllm import live, live_admin_servers
from kvoffload.vllm.admin import VLLMHostedManager, serve_admin

ADMIN = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(autouse=True)
def admin_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVOFFLOAD_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("KVOFFLOAD_HOST", "127.0.0.1")
    yield
    gc.collect()
    for server in live_admin_servers():  # left by a failed test
        server.stop()


def new_manager(enable_events: bool = False) -> PolicyOffloadingManager:
    return PolicyOffloadingManager(
        CPUBackend(block_size=16, num_blocks=4), policy="lru", enable_events=enable_events
    )


def steps(manager: PolicyOffloadingManager | VLLMHostedManager) -> Iterator[None]:
    """What a scheduler does, step by step: stores that fill the tier, a
    load, stores that evict; yields after each step."""
    for first in range(0, 12, 2):
        chain = [BlockHash(f"b{first + i}".encode()) for i in range(2)]
        hit = manager.lookup(chain)
        if hit:
            manager.prepare_load(chain[:hit])
            manager.complete_load(chain[:hit])
        out = manager.prepare_store(chain)
        if out is not None:
            manager.complete_store(out.block_hashes_to_store)
        yield
        manager.touch([BlockHash(b"b0")])
        yield


def served(port: int = 0, *, vllm_events: bool = False) -> VLLMHostedManager:
    return serve_admin(new_manager(), port, vllm_events=vllm_events)


@pytest.mark.parametrize("vllm_events", [True, False])
def test_vllm_take_events_is_what_the_bare_manager_gives_while_readers_see_all(
    vllm_events: bool,
) -> None:
    """vLLM's take_events gets, step by step, what it got from the bare
    manager: the events when vLLM enabled them, else none. The log keeps
    every record for /v1/events readers (a read removes nothing)."""
    bare = new_manager(enable_events=vllm_events)
    hosted = VLLMHostedManager(new_manager(), vllm_events=vllm_events)
    got, expected = [], []
    for _ in zip(steps(bare), steps(hosted), strict=True):
        expected.append(bare.take_events())
        got.append(hosted.take_events())
    assert got == expected
    assert any(ev.removed for batch in got for ev in batch) == vllm_events
    log = hosted.event_log
    assert log is not None
    records = log.read(0).records
    assert [r.kind for r in records].count("removed") > 0
    assert log.read(0).records == records  # non-destructive
    if vllm_events:
        stored = [r.to_offloading_event() for r in records]
        assert stored == [ev for batch in got for ev in batch]


def test_steps_are_vllm_scheduler_steps_not_host_calls() -> None:
    """vLLM's scheduler calls take_events once, at the end of each step: the
    snapshot's step and a command's applied_at_step count those, as the
    runtime's count its engine steps (the host's calls are many more)."""
    hosted = VLLMHostedManager(new_manager(), vllm_events=False)
    hosted.snapshot_max_age = 0.0
    n = 0
    for _ in steps(hosted):
        hosted.take_events()
        n += 1
    assert hosted.snapshot().step == n == 12
    assert hosted.switch_policy("arc").result(timeout=1).applied_at_step == n
    # within step n + 1: a lookup that found blocks holds a reset back until
    # the host's next call has returned
    assert hosted.lookup([BlockHash(b"b0")]) == 1
    reset = hosted.reset()
    hosted.touch([BlockHash(b"b0")])
    assert reset.result(timeout=1).applied_at_step == n
    hosted.take_events()
    assert hosted.snapshot().step == n + 1


def test_served_manager_answers_over_http_and_refuses_drains() -> None:
    hosted = served()
    (server,) = live_admin_servers()
    for _ in steps(hosted):
        pass
    # a snapshot may be up to snapshot_max_age (50 ms) old by contract, and
    # the steps take less: read the latest, not whatever the timing gives
    hosted.snapshot_max_age = 0.0
    cache = httpx.get(f"{server.url}/v1/cache").json()
    counters = hosted.stats().counters
    assert cache["counters"]["store_blocks"] == counters.store_blocks
    assert cache["counters"]["evictions"] == counters.evictions
    assert cache["workload"].startswith("vLLM engine core (pid ")
    events = httpx.get(f"{server.url}/v1/events").json()["events"]
    assert len(events) == hosted.event_log.last_seq  # type: ignore[union-attr]
    drain = httpx.post(f"{server.url}/v1/events:drain", headers=AUTH)
    assert drain.status_code == 409
    assert drain.json()["error"]["code"] == "not_supported"
    assert "GET /v1/events?after_seq=N, which removes nothing" in drain.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/events").json()["events"] == events
    del hosted
    gc.collect()
    assert not server.running


def test_served_manager_switches_policy_and_resets_over_http_even_when_empty() -> None:
    hosted = served()
    (server,) = live_admin_servers()
    put = httpx.put(f"{server.url}/v1/policy", json={"policy": "arc"}, headers=AUTH)
    assert put.status_code == 200, put.text
    assert (put.json()["policy"], hosted.policy_name) == ("arc", "arc")
    reset = httpx.post(f"{server.url}/v1/cache:reset", json={"confirm": True}, headers=AUTH)
    assert reset.status_code == 200, reset.text
    target = server.service.target
    del hosted
    gc.collect()
    assert target.state == "stopped"
    with pytest.raises(EngineStoppedError, match="vLLM's engine has shut down"):
        target.switch_policy("lru").result(timeout=1)


def test_server_stops_when_vllm_drops_the_manager_and_frees_the_port() -> None:
    """The server holds the manager weakly: once vLLM's scheduler is gone, so
    is the server and its transfer listener, and the port can be reused."""
    hosted = served()
    (server,) = live_admin_servers()
    listener = server.prometheus.transfer_finished
    live.report(TransferRecord(1, "load", 2, 8192, 0, 2_000_000, True))
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'kvoffload_transfer_bytes_total{direction="load"} 8192.0' in metrics
    assert 'kvoffload_transfer_duration_seconds_count{direction="load"} 1.0' in metrics
    assert listener in live._listeners
    port = server.port
    del hosted
    gc.collect()
    assert not server.running and server not in live_admin_servers()
    assert listener not in live._listeners
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/v1/cache")
    again = served(port)  # the same port, for the next engine
    assert [s.port for s in live_admin_servers()] == [port]
    del again
    gc.collect()
    assert live_admin_servers() == []


def test_records_readers_missed_are_a_warning_per_scheduler_step_over_otlp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No engine loop inside vLLM, but its scheduler calls take_events at the
    end of every step: that is where the missed-records check runs. One
    warning a step at most (the interval holds the next back), and what is
    still held back goes out when the server stops."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    with running_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        # the extra config's event_log_capacity, with vLLM's events off
        hosted = serve_admin(new_manager(), 0, vllm_events=False, event_log_capacity=4)
        (server,) = live_admin_servers()
        assert server.service.target.event_log.capacity == 4
        for _ in steps(hosted):
            pass
        last = hosted.event_log.last_seq  # type: ignore[union-attr]
        # a reader whose cursor fell behind the ring of 4
        page = httpx.get(f"{server.url}/v1/events", params={"after_seq": 1}).json()
        first = last - 4 - 1
        assert page["missed"] == first > 0
        hosted.take_events()  # the end of a scheduler step: reported now
        page = httpx.get(f"{server.url}/v1/events", params={"after_seq": 2}).json()
        assert page["missed"] == first - 1
        hosted.take_events()  # within the interval: held back
        del hosted
        gc.collect()  # the server stops, and reports what was held back
        assert not server.running
    warnings = [r for r in receiver.log_records() if r.event_name == "kvoffload.events_missed"]
    assert [attrs(r.attributes) for r in warnings] == [
        {"kvoffload.events.missed": first, "kvoffload.events.missed_total": first},
        {"kvoffload.events.missed": first - 1, "kvoffload.events.missed_total": 2 * first - 1},
    ]
    assert {r.severity_text for r in warnings} == {"WARN"}


class Worker:
    """Stands for a worker's handler: vLLM's engine shutdown frees it."""


def test_server_stops_when_a_worker_of_its_engine_is_freed() -> None:
    """vLLM freezes its engine's objects (gc.freeze), so the manager is never
    collected in-process; shutting the engine down frees the worker's
    handler, and the server stops with it, before the manager is gone."""
    worker = Worker()
    hosted = serve_admin(new_manager(), 0, vllm_events=False, workers=[worker])
    (server,) = live_admin_servers()
    del worker
    assert not server.running
    assert hosted.take_events() == []  # vLLM may go on calling it
    del hosted
    gc.collect()


def test_port_in_use_fails_naming_the_port_and_the_setting() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            served(port)
    message = str(info.value)
    assert message.startswith(
        f"kvoffload admin server (admin_port {port} of kv_connector_extra_config, "
        "host '127.0.0.1' from KVOFFLOAD_HOST): cannot listen on 127.0.0.1:"
    )
    assert "choose another admin_port, or 0 for any free port" in message
    assert live_admin_servers() == []


def test_bad_settings_fail_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_HOST", "0.0.0.0")
    monkeypatch.delenv("KVOFFLOAD_ADMIN_TOKEN")
    with pytest.raises(ConfigError, match="the KVOFFLOAD_\\* settings are invalid") as info:
        served()
    assert "refusing to bind '0.0.0.0' without an admin token" in str(info.value)
