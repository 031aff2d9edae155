"""kvoffload's admin API inside a real vLLM 0.11.2 engine (``admin_port``):
what it shows matches what vLLM did, a live policy switch between two
``generate`` calls, the same over OTLP, a reader's missed records warned of
at the next scheduler step, vLLM's KV events unchanged, resets that cannot
break a load, and a server that lives and dies with the engine."""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import pytest

# tests/ is on the path (pytest's rootdir-based imports): the main suite's receiver
from instrumentation.otlp_receiver import Receiver, attrs, running_receiver

from kvoffload import ConfigError
from kvoffload.instrumentation.catalogue import METRICS
from kvoffload.vllm import live_admin_servers

from .workload import (
    GPU_BLOCK_SIZE,
    PREFIX_TOKENS,
    Run,
    free_port,
    kvoffload_extra,
    make_llm,
    run_workload,
)

BIG_TIER = 256
ADMIN = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PREFIX_BLOCKS = PREFIX_TOKENS // GPU_BLOCK_SIZE


#: one port for every engine of this module: each must free it for the next
PORT = free_port()


def server_url() -> str:
    (server,) = live_admin_servers()
    assert server.port == PORT
    return server.url


def cache_of(url: str, manager: Any) -> dict[str, Any]:
    """GET /v1/cache once its counters are the manager's (read directly): the
    API serves snapshots, which a hosted manager may publish up to 50 ms
    after vLLM's last call."""
    c = manager.stats().counters
    expected = {
        f.name: dict(v) if isinstance(v := getattr(c, f.name), Mapping) else v for f in fields(c)
    }
    deadline = time.monotonic() + 10
    while (cache := httpx.get(f"{url}/v1/cache").json())["counters"] != expected:
        assert time.monotonic() < deadline, (cache["counters"], expected)
        time.sleep(0.02)
    return cache


def metric(url: str, sample: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics")


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """An OTLP/HTTP receiver the engine's kvoffload exports to, every span sampled."""
    with running_receiver() as r:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
        yield r


def test_engine_admin_api_shows_what_vllm_did_and_switches_policy_between_generates(
    model_dir: Path, baseline: Run, monkeypatch: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    monkeypatch.setenv("KVOFFLOAD_ADMIN_TOKEN", ADMIN)
    seen: dict[str, Any] = {}

    def before(name: str, manager: Any) -> None:
        url = server_url()
        seen[name] = cache_of(url, manager)  # what the manager vLLM drives holds
        if name == "a_again":
            # between the generate of x4 and that of a_again, which loads P
            assert httpx.get(f"{url}/v1/policy").json()["policy"] == "lru"
            put = httpx.put(
                f"{url}/v1/policy", json={"policy": "arc", "expected_version": 1}, headers=AUTH
            )
            assert put.status_code == 200, put.text
            seen["switch"] = put.json()
            seen["policy"] = httpx.get(f"{url}/v1/policy").json()
            seen["after_switch"] = httpx.get(f"{url}/v1/cache").json()
            seen["info"] = metric(url, 'kvoffload_policy_info{policy="arc"}')
        if name == "end":
            seen["loads"] = metric(
                url, 'kvoffload_transfer_jobs_total{direction="load",outcome="ok"}'
            )
            seen["load_count"] = metric(
                url, 'kvoffload_transfer_duration_seconds_count{direction="load"}'
            )
            seen["load_blocks_metric"] = metric(
                url, 'kvoffload_transfer_gpu_blocks_total{direction="load"}'
            )
            seen["load_bucket_inf"] = metric(
                url, 'kvoffload_transfer_duration_seconds_bucket{direction="load",le="+Inf"}'
            )
            seen["exposition"] = httpx.get(f"{url}/metrics").text
            seen["events"] = httpx.get(f"{url}/v1/events").json()
            seen["events_again"] = httpx.get(f"{url}/v1/events").json()
            seen["url"] = url

    run = run_workload(
        model_dir,
        kvoffload_extra(num_cpu_blocks=BIG_TIER, eviction_policy="lru", admin_port=PORT),
        before=before,
    )
    # the generate after the switch is the run without offloading's
    assert run.outputs() == baseline.outputs()
    assert run.steps["a_again"].cached_tokens == PREFIX_TOKENS
    # the switch, visible in /v1/policy, /v1/cache and /metrics
    assert seen["switch"]["policy"] == "arc" and seen["switch"]["previous_policy"] == "lru"
    # applied after the last of vLLM's scheduler steps so far (idle between generates)
    assert seen["switch"]["applied_at_step"] == seen["after_switch"]["step"] > 0
    assert seen["policy"]["policy"] == "arc" and seen["policy"]["version"] == 2
    after = seen["after_switch"]
    assert (after["policy"], after["policy_version"]) == ("arc", 2)
    assert after["counters"]["policy_switches"] == 1
    # resident blocks migrate to ARC's lists, nothing is flushed
    assert after["blocks"]["used"] == seen["a_again"]["blocks"]["used"] > 0
    assert after["arc"]["t1"] + after["arc"]["t2"] == after["blocks"]["used"]
    assert seen["info"] == 1.0
    # a_again's prefix, loaded under ARC: the counters say what vLLM did
    before_a, end = seen["a_again"]["counters"], seen["end"]["counters"]
    assert end["hit_blocks"] - before_a["hit_blocks"] == PREFIX_BLOCKS
    assert end["load_blocks"] - before_a["load_blocks"] == PREFIX_BLOCKS
    # every block vLLM offloaded is in the tier: stored, or (the last job,
    # which vLLM completes at its next step) in flight
    stored = sum(s.transferred("store") for s in run.steps.values())
    blocks = seen["end"]["blocks"]
    assert end["store_blocks"]["stored"] + blocks["in_flight"] == stored == blocks["used"]
    # the worker runs in the engine-core process: its transfers are in /metrics
    loads = [t for s in run.steps.values() for t in s.transfers if t[0] == "load"]
    assert seen["loads"] == seen["load_count"] == seen["load_bucket_inf"] == len(loads) >= 1
    assert seen["load_blocks_metric"] == sum(n for _, n, _, _ in loads) == PREFIX_BLOCKS
    # and the whole catalogue
    missing = [m.name for m in METRICS if f"# TYPE {m.name} " not in seen["exposition"]]
    assert missing == []
    # vLLM did not enable KV events: it published none, /v1/events has them all
    assert run.published == []
    events = seen["events"]["events"]
    assert [e["kind"] for e in events].count("policy_switched") == 1
    stored_hashes = [h for e in events if e["kind"] == "stored" for h in e["block_hashes"]]
    assert len(stored_hashes) == end["store_blocks"]["stored"]
    assert seen["events_again"] == seen["events"]  # reads remove nothing
    # the server stopped with the engine; its port is free for the next one
    assert live_admin_servers() == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{seen['url']}/v1/cache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", PORT))

    # OTLP (flushed as the server stopped): the switch as an admin span and a
    # log record in its trace, each load job vLLM ran as a transfer span,
    # and the catalogue as metrics
    spans = receiver.spans()
    (switch,) = [s for s in spans if s.name == "kvoffload.admin.switch_policy"]
    assert attrs(switch.attributes)["kvoffload.admin.outcome"] == "applied"
    assert attrs(switch.attributes)["kvoffload.policy"] == "arc"
    (record,) = [r for r in receiver.log_records() if r.event_name == "kvoffload.policy_switch"]
    assert attrs(record.attributes) == {
        "kvoffload.command": "switch_policy",
        "kvoffload.step": seen["switch"]["applied_at_step"],
        "kvoffload.policy": "arc",
        "kvoffload.policy.version": 2,
        "kvoffload.policy.previous": "lru",
    }
    assert record.trace_id == switch.trace_id
    transfers = [attrs(s.attributes) for s in spans if s.name == "kvoffload.transfer"]
    load_spans = [t for t in transfers if t["kvoffload.transfer.direction"] == "load"]
    assert len(load_spans) == len(loads)
    assert sum(t["kvoffload.transfer.blocks"] for t in load_spans) == PREFIX_BLOCKS
    assert any(t["kvoffload.transfer.direction"] == "store" for t in transfers)
    _, points = receiver.metric_exports()[-1]
    assert points["kvoffload_policy_info"] == [({"policy": "arc"}, 1)]
    jobs = {(p["direction"], p["outcome"]): v for p, v in points["kvoffload_transfer_jobs"]}
    assert jobs[("load", "ok")] == len(loads)


def test_engine_warns_at_its_next_step_of_records_a_reader_missed(
    model_dir: Path, receiver: Receiver
) -> None:
    """event_log_capacity sizes the ring; a /v1/events reader whose cursor
    fell behind it is told how many records it missed, and vLLM's next
    scheduler step (its take_events) sends the warning over OTLP, before the
    engine stops (without the per-step check only the server's stop would)."""
    seen: dict[str, Any] = {}

    def before(name: str, manager: Any) -> None:
        if name == "a_again":
            page = httpx.get(f"{server_url()}/v1/events", params={"after_seq": 1}).json()
            seen["missed"], seen["last_seq"] = page["missed"], page["last_seq"]
        if name == "end":
            seen["end_ns"] = time.time_ns()

    extra = kvoffload_extra(
        num_cpu_blocks=BIG_TIER, eviction_policy="lru", admin_port=PORT, event_log_capacity=1
    )
    run_workload(model_dir, extra, before=before)
    assert seen["missed"] == seen["last_seq"] - 1 - 1 > 0
    warnings = [r for r in receiver.log_records() if r.event_name == "kvoffload.events_missed"]
    (warning,) = warnings
    assert attrs(warning.attributes) == {
        "kvoffload.events.missed": seen["missed"],
        "kvoffload.events.missed_total": seen["missed"],
    }
    assert warning.severity_text == "WARN"
    assert warning.time_unix_nano < seen["end_ns"]


def test_engine_vllm_kv_events_unchanged_while_v1_events_reads_them_all(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With vLLM's KV events on, its scheduler publishes exactly the batches
    it published without the admin server, evictions included, while
    /v1/events (read twice: reads remove nothing) holds every one of them."""
    # vLLM seeds its block hashes from PYTHONHASHSEED, else at random per
    # engine; its connector completes a request's stores as a set of them,
    # so without a seed the order (and the LRU victims) differ between runs
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = kvoffload_extra(num_cpu_blocks=48, block_size=64, eviction_policy="lru")
    plain = run_workload(model_dir, extra, kv_events=True)
    reads: list[dict[str, Any]] = []

    def before(name: str, manager: Any) -> None:
        if name == "end":
            url = server_url()
            reads.extend(httpx.get(f"{url}/v1/events").json() for _ in range(2))

    served = run_workload(model_dir, {**extra, "admin_port": PORT}, kv_events=True, before=before)
    assert served.published == plain.published
    assert any(removed for batch in plain.published for removed, _ in batch)
    assert any(not removed for batch in plain.published for removed, _ in batch)
    first, second = reads
    assert first == second
    logged = [
        (e["kind"] == "removed", tuple(bytes.fromhex(h) for h in e["block_hashes"]))
        for e in first["events"]
    ]
    assert logged == [event for batch in served.published for event in batch]


def test_engine_reset_arriving_during_vllm_lookup_waits_for_its_load(
    model_dir: Path, baseline: Run
) -> None:
    """An operator's reset (the call POST /v1/cache:reset makes) arrives
    while vLLM's scheduler looks up A's prefix: applied before the
    prepare_load that follows, it would evict what the lookup counted and
    the load would raise inside vLLM's scheduler. It lands after the load
    pinned the prefix: everything else goes, A is served from the tier."""
    resets: list[Any] = []

    def before(name: str, manager: Any) -> None:
        if name != "a_again":
            return
        inner = manager.manager
        lookup = inner.lookup

        def lookup_then_reset(block_hashes: Any) -> int:
            hits = int(lookup(block_hashes))
            if hits and not resets:
                resets.append(manager.reset())
                # what a reset after the load leaves: the pinned hits, and
                # x4's stores, which vLLM completes once x4 is reported done
                now = inner.stats()
                resets.append(now.used - now.in_flight - now.pinned - hits)
            return hits

        inner.lookup = lookup_then_reset

    run = run_workload(
        model_dir,
        kvoffload_extra(num_cpu_blocks=BIG_TIER, eviction_policy="lru", admin_port=0),
        before=before,
    )
    assert run.outputs() == baseline.outputs()
    step = run.steps["a_again"]
    assert step.cached_tokens == PREFIX_TOKENS
    assert step.hit_blocks == step.load_blocks == PREFIX_BLOCKS
    reset, evictable = resets
    assert evictable >= 3 * PREFIX_BLOCKS  # x1..x3 at least
    assert int(reset.result(timeout=5).detail["cpu_blocks_evicted"]) == evictable


def test_engine_start_fails_naming_admin_port_when_it_is_taken(model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            make_llm(model_dir, kvoffload_extra(num_cpu_blocks=8, admin_port=port))
    message = str(info.value)
    assert f"admin_port {port} of kv_connector_extra_config" in message
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in message
    assert "choose another admin_port, or 0 for any free port" in message
    assert live_admin_servers() == []
    # and the advice works in this process: the failed engine's worker
    # connector, which vLLM keeps in a process global, was let go (an audit
    # found the retry failing on vLLM's bare assert, its handler registered
    # twice)
    run = run_workload(model_dir, kvoffload_extra(num_cpu_blocks=BIG_TIER, admin_port=0))
    assert run.stats is not None and run.stats.counters.store_blocks["stored"] > 0


def test_engine_refuses_an_otlp_protocol_it_cannot_export_over(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ConfigError) as info:
        make_llm(model_dir, kvoffload_extra(num_cpu_blocks=8, admin_port=0))
    assert str(info.value).startswith(
        "kvoffload admin server (admin_port 0 of kv_connector_extra_config): "
        "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not a protocol kvoffload exports"
    )
    assert live_admin_servers() == []


def test_a_second_engine_in_the_process_is_refused_saying_why(model_dir: Path) -> None:
    # vLLM 0.11.2 keeps one worker connector per process: with the engine
    # core in this process, a second engine's worker got the first's, and
    # vLLM failed on a bare assert as it registered its handler again (audit)
    first = make_llm(model_dir, kvoffload_extra(num_cpu_blocks=8))
    try:
        with pytest.raises(ConfigError) as info:
            make_llm(model_dir, kvoffload_extra(num_cpu_blocks=8))
        assert "vLLM 0.11.2 keeps one KV connector per process" in str(info.value)
        assert "llm.llm_engine.engine_core.shutdown()" in str(info.value)
    finally:
        first.llm_engine.engine_core.shutdown()
        del first
        gc.collect()
