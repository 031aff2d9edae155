"""Every view of a running service tells the same numbers (issue 18).

One replay of a Mooncake trace under ``kvoffload serve``, with transfer failures
injected, OTLP going to a receiver that decodes the protobuf, every trace sampled,
and a reader tailing the event log over SSE. The policy is switched three times,
the engine paused, part of the log drained. At that paused moment ``/metrics``,
``/v1/cache``, the event log, the spans, the log records and the last OTLP metrics
export must agree on every quantity they share; after SIGTERM the final OTLP
export must say the same, with the engine down.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.instrumentation import METRICS

from .otlp_receiver import MetricPoints, Receiver, attrs, running_receiver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
from served import ADMIN, READ, ROOT, served

TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
FLAGS = (
    "--workload", str(TRACE), "--speed", "0",
    # trace-sized blocks keep the per-block Python work (and the test) short; a
    # small GPU cache sends the reuse to the CPU tier, which still evicts
    "--gpu-block-size", "512", "--offloaded-block-size", "512",
    "--gpu-blocks", "16", "--num-cpu-blocks", "1024", "--max-requests-per-step", "2",
    "--num-layers", "1", "--num-kv-heads", "1",
    "--inject-failure-rate", "0.1",
    # the tailer reads every record from the start: nothing may be missed
    "--event-log-capacity", "1000000", "--sse-max-replay", "1000000",
)  # fmt: skip
OTEL = {
    "OTEL_TRACES_SAMPLER": "always_on",
    "OTEL_METRIC_EXPORT_INTERVAL": "200",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "OTEL_BLRP_SCHEDULE_DELAY": "100",
    # nothing may be dropped on the way: the comparison is exact
    "OTEL_BSP_MAX_QUEUE_SIZE": "1000000",
    "OTEL_BLRP_MAX_QUEUE_SIZE": "1000000",
}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def wait_until(what: str, ready: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def scrape(http: httpx.Client) -> Samples:
    text = http.get("/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def series_labels(samples: Samples, name: str) -> list[dict[str, str]]:
    """The label sets of ``name``'s samples."""
    return [dict(ls) for n, ls in samples if n == name]


def otlp_as_samples(points: MetricPoints) -> Samples:
    """An OTLP export under the names /metrics gives the same numbers (counters
    without ``_total`` there, histograms as their count and sum)."""
    names = {}
    for spec in METRICS:
        if spec.type == "counter":
            names[spec.base_name] = spec.name
        elif spec.type == "gauge":
            names[spec.name] = spec.name
        else:
            names.update({f"{spec.name}_{p}": f"{spec.name}_{p}" for p in ("count", "sum")})
    return {
        (names[name], frozenset((k, str(v)) for k, v in labels.items())): float(v)
        for name, series in points.items()
        for labels, v in series
    }


def comparable(samples: Samples) -> Samples:
    """/metrics samples the OTLP export carries too (not histogram buckets),
    less the admin API's own: every scrape and wait of this test moves them."""
    return {
        key: v
        for key, v in samples.items()
        if not key[0].endswith("_bucket") and not key[0].startswith("kvoffload_api_")
    }


def export_after(receiver: Receiver, since_ns: int) -> Samples:
    """The first OTLP metrics export made entirely after ``since_ns``."""
    found: list[Samples] = []

    def ready() -> bool:
        later = [points for at, points in receiver.metric_exports() if at > since_ns]
        found[:] = [otlp_as_samples(later[0])] if later else []
        return bool(found)

    wait_until("an OTLP metrics export", ready)
    return found[0]


def span_attrs(receiver: Receiver, name: str) -> list[dict[str, Any]]:
    return [attrs(s.attributes) for s in receiver.spans() if s.name == name]


def log_attrs(receiver: Receiver, event: str) -> list[dict[str, Any]]:
    return [attrs(r.attributes) for r in receiver.log_records() if r.event_name == event]


def tail(base: str, records: list[dict[str, Any]], missed: list[dict[str, Any]]) -> None:
    """Read the event stream from the first record until the service ends it."""
    with httpx.stream(
        "GET", f"{base}/v1/events/stream?after_seq=0", headers=READ, timeout=None
    ) as r:
        event = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                (missed if event == "missed" else records).append(json.loads(line[6:]))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as r:
        yield r


def test_every_view_agrees_at_a_paused_moment_and_after_shutdown(receiver: Receiver) -> None:
    env = {**OTEL, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
    records: list[dict[str, Any]] = []
    missed: list[dict[str, Any]] = []
    with (
        served(*FLAGS, env=env) as service,
        httpx.Client(base_url=service.base, headers=ADMIN, timeout=30.0) as http,
    ):
        tailer = threading.Thread(target=tail, args=(service.base, records, missed))
        tailer.start()

        def steps() -> int:
            n: int = http.get("/v1/cache").json()["runtime"]["steps"]
            return n

        def failed_loads() -> float:
            jobs = scrape(http)
            return value(jobs, "kvoffload_transfer_jobs_total", direction="load", outcome="failed")

        wait_until("a first stretch of steps", lambda: steps() >= 200)
        switched = []
        for policy in ("arc", "lru", "hkvarc"):  # ends on hkvarc: its counts, its lists
            answer = http.put("/v1/policy", json={"policy": policy})
            assert answer.status_code == 200, answer.text
            switched.append((answer.json()["previous_policy"], policy))
            at = answer.json()["applied_at_step"]
            wait_until(f"steps under {policy}", lambda at=at: steps() >= at + 100)
        wait_until("loads that failed (one in ten of all jobs)", lambda: failed_loads() >= 2)
        assert http.post("/v1/runtime:pause").status_code == 200
        last_seq = http.get("/v1/events?limit=1").json()["last_seq"]
        wait_until(
            "the tailer to catch up", lambda: bool(records) and records[-1]["seq"] == last_seq
        )
        drain = http.post("/v1/events:drain", json={"limit": 100}).json()
        quiet_ns = time.time_ns()

        cache = http.get("/v1/cache").json()
        rt, c, ev = cache["runtime"], cache["counters"], cache["events"]
        wait_until(
            "every span to arrive",
            lambda: (
                len(span_attrs(receiver, "kvoffload.step")) == rt["steps"]
                and len(span_attrs(receiver, "kvoffload.request")) == rt["requests"]
                and len(span_attrs(receiver, "kvoffload.transfer"))
                == rt["load_jobs"] + rt["store_jobs"]
                and len(span_attrs(receiver, "kvoffload.admin.drain_events")) == 1
            ),
        )
        wait_until(
            "every log record to arrive",
            lambda: (
                len(log_attrs(receiver, "kvoffload.policy_switch")) == 3
                and len(log_attrs(receiver, "kvoffload.command")) == 1
            ),
        )
        metrics = scrape(http)
        otlp = export_after(receiver, quiet_ns)
        paused = comparable(metrics)

        # -- the state: paused, settled, failures injected -------------------------
        assert cache["state"] == "paused"
        assert (
            value(metrics, "kvoffload_runtime_up"),
            value(metrics, "kvoffload_runtime_paused"),
        ) == (1, 1)
        assert cache["blocks"]["in_flight"] == cache["blocks"]["pinned"] == 0
        assert (
            rt["gpu_hit_tokens"]
            + rt["cpu_hit_tokens"]
            + rt["computed_tokens"]
            + rt["truncated_tokens"]
            == rt["prompt_tokens"]
        )
        assert (
            value(metrics, "kvoffload_transfer_jobs_total", direction="load", outcome="failed") > 0
        )
        assert (
            value(metrics, "kvoffload_transfer_jobs_total", direction="store", outcome="failed") > 0
        )
        assert rt["cpu_hit_tokens"] > 0 and sum(c["evictions"].values()) > 0
        assert rt["verify_failures"] == 0

        # -- OTLP metrics: the same numbers as /metrics, every one of them ---------
        assert comparable(otlp) == paused
        # the API's own too, where nothing moves them now: three switches, one pause
        for name, count in (("PUT /v1/policy", 3), ("POST /v1/runtime:pause", 1)):
            key = ("kvoffload_api_requests_total", frozenset({("name", name), ("outcome", "200")}))
            assert metrics[key] == otlp[key] == count

        # -- /v1/cache against /metrics --------------------------------------------
        pairs = {
            "lookups": "kvoffload_lookups_total",
            "lookup_blocks": "kvoffload_lookup_blocks_total",
            "hit_blocks": "kvoffload_lookup_hit_blocks_total",
            "load_blocks": "kvoffload_load_blocks_total",
            "load_completed_blocks": "kvoffload_load_completed_blocks_total",
            "touches": "kvoffload_touched_blocks_total",
            "store_prepared_blocks": "kvoffload_store_prepared_blocks_total",
            "rejected_stores": "kvoffload_store_rejections_total",
            "policy_switches": "kvoffload_policy_switches_total",
        }
        for field, metric in pairs.items():
            assert c[field] == value(metrics, metric), field
        for outcome, n in c["store_blocks"].items():
            assert n == value(metrics, "kvoffload_store_blocks_total", outcome=outcome), outcome
        for lst, n in c["evictions"].items():
            assert n == value(metrics, "kvoffload_evictions_total", list=lst), lst
        for state, n in cache["blocks"].items():
            assert n == value(metrics, f"kvoffload_{state}_blocks", medium="CPU"), state
        for outcome in ("gpu_hit", "cpu_hit", "computed"):
            tokens = value(metrics, "kvoffload_runtime_prompt_tokens_total", outcome=outcome)
            assert rt[f"{outcome}_tokens"] == tokens, outcome
        assert rt["steps"] == cache["step"] == value(metrics, "kvoffload_runtime_steps_total")
        assert rt["requests"] == value(metrics, "kvoffload_runtime_requests_total")
        for direction, verb in (("load", "loaded"), ("store", "stored")):
            jobs = total(metrics, "kvoffload_transfer_jobs_total", direction=direction)
            assert rt[f"{direction}_jobs"] == jobs, direction
            blocks = value(metrics, "kvoffload_transfer_gpu_blocks_total", direction=direction)
            assert rt[f"{verb}_gpu_blocks"] == blocks, direction
            nbytes = value(metrics, "kvoffload_transfer_bytes_total", direction=direction)
            assert rt[f"{verb}_bytes"] == nbytes, direction
        assert rt["failed_jobs"] == total(
            metrics, "kvoffload_transfer_jobs_total", outcome="failed"
        )
        for field in (
            "appended",
            "overwritten",
            "drained",
            "missed",
            "buffered",
            "capacity",
            "last_seq",
        ):
            metric = f"kvoffload_events_{field}" + (
                "_total" if field in {"appended", "overwritten", "drained", "missed"} else ""
            )
            assert ev[field] == value(metrics, metric), field
        for lst, n in cache["lists"].items():
            assert n == value(metrics, "kvoffload_policy_list_blocks", policy="hkvarc", list=lst)
        assert {"h1", "h2"} <= set(cache["lists"])
        assert cache["policy_counters"] and set(cache["policy_counters"]) == {
            labels["name"] for labels in series_labels(metrics, "kvoffload_policy_counts_total")
        }
        for name, n in cache["policy_counters"].items():
            labels = frozenset({"policy": "hkvarc", "name": name}.items())
            assert n == metrics[("kvoffload_policy_counts_total", labels)], name
        assert cache["policy_counters"]["deferred"] > 0  # the runtime's hints reached it
        window = cache["window"]
        assert window["requests"] > 0 and window["uses"] >= window["blocks"] > 0
        for field in ("requests", "uses", "blocks"):
            assert window[field] == value(metrics, f"kvoffload_hint_window_{field}"), field
        assert window["resident"] == value(metrics, "kvoffload_hint_window_resident_blocks")
        assert cache["policy_version"] == value(metrics, "kvoffload_policy_version") == 4
        assert value(metrics, "kvoffload_policy_info", policy=cache["policy"]) == 1

        # -- the event log, as the tailer read it, and the drain -------------------
        assert missed == [] and ev["missed"] == 0
        assert [r["seq"] for r in records] == list(range(1, ev["last_seq"] + 1))
        assert ev["appended"] == len(records) and ev["overwritten"] == 0
        assert len(drain["events"]) == ev["drained"] == 100
        assert drain["remaining"] == ev["buffered"] == len(records) - 100
        kinds = Counter(r["kind"] for r in records)
        stored = sum(len(r["block_hashes"]) for r in records if r["kind"] == "stored")
        assert stored == c["store_blocks"]["stored"]
        removed = [r for r in records if r["kind"] == "removed"]
        assert sum(len(r["block_hashes"]) for r in removed) == sum(c["evictions"].values())
        by_list: Counter[str] = Counter()
        for r in removed:
            by_list.update({k: int(n) for k, n in r["detail"].items()})
        assert by_list == +Counter(c["evictions"])
        switches = [r["detail"] for r in records if r["kind"] == "policy_switched"]
        assert [(d["from"], d["to"]) for d in switches] == switched
        assert kinds["policy_switched"] == c["policy_switches"] == 3

        # -- spans -----------------------------------------------------------------
        requests = span_attrs(receiver, "kvoffload.request")
        for outcome in ("gpu_hit", "cpu_hit", "computed"):
            spanned = sum(a[f"kvoffload.request.{outcome}_tokens"] for a in requests)
            assert spanned == rt[f"{outcome}_tokens"], outcome
        assert sum(a["gen_ai.usage.input_tokens"] for a in requests) == rt["prompt_tokens"]
        assert sum(a["gen_ai.usage.cache_read.input_tokens"] for a in requests) == (
            rt["gpu_hit_tokens"] + rt["cpu_hit_tokens"]
        )
        transfers = span_attrs(receiver, "kvoffload.transfer")
        jobs = Counter(
            (a["kvoffload.transfer.direction"], a["kvoffload.transfer.outcome"]) for a in transfers
        )
        for (direction, outcome), n in jobs.items():
            metric_outcome = "ok" if outcome == "ok" else "failed"
            assert n == value(
                metrics,
                "kvoffload_transfer_jobs_total",
                direction=direction,
                outcome=metric_outcome,
            ), (direction, outcome)
        for direction in ("load", "store"):
            ok = [
                a
                for a in transfers
                if a["kvoffload.transfer.direction"] == direction
                and a["kvoffload.transfer.outcome"] == "ok"
            ]
            blocks = value(metrics, "kvoffload_transfer_gpu_blocks_total", direction=direction)
            assert sum(a["kvoffload.transfer.blocks"] for a in ok) == blocks, direction
            nbytes = value(metrics, "kvoffload_transfer_bytes_total", direction=direction)
            assert sum(a["kvoffload.transfer.bytes"] for a in ok) == nbytes, direction
        admin = Counter(
            a["kvoffload.admin.action"]
            for a in span_attrs(receiver, "kvoffload.admin.switch_policy")
            + span_attrs(receiver, "kvoffload.admin.pause")
        )
        assert admin == {"switch_policy": 3, "pause": 1}
        (drained_span,) = span_attrs(receiver, "kvoffload.admin.drain_events")
        assert drained_span["kvoffload.events.drained"] == 100

        # -- log records -----------------------------------------------------------
        evictions = log_attrs(receiver, "kvoffload.eviction")
        assert sum(a["kvoffload.eviction.blocks"] for a in evictions) == sum(
            c["evictions"].values()
        )
        logged: Counter[str] = Counter()
        for a in evictions:
            logged.update(
                {
                    k.rsplit(".", 1)[1]: int(v)
                    for k, v in a.items()
                    if k.startswith("kvoffload.eviction.blocks.")
                }
            )
        assert logged == by_list
        switch_logs = log_attrs(receiver, "kvoffload.policy_switch")
        assert [
            (a["kvoffload.policy.previous"], a["kvoffload.policy"]) for a in switch_logs
        ] == switched
        assert log_attrs(receiver, "kvoffload.events_missed") == []

        # -- after SIGTERM: the final export says the same, the engine down --------
        spans_before = len(receiver.spans())
        stop_ns = time.time_ns()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(60) == 0
        tailer.join(30)
        assert not tailer.is_alive()
    final = max(receiver.metric_exports(), key=lambda export: export[0])
    assert final[0] > stop_ns
    down = {
        ("kvoffload_runtime_up", frozenset()): 0.0,
        ("kvoffload_runtime_paused", frozenset()): 0.0,
    }
    assert comparable(otlp_as_samples(final[1])) == {**paused, **down}
    assert len(receiver.spans()) == spans_before  # no step, no job after the pause
    assert len(records) == ev["last_seq"] and missed == []
