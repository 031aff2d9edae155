"""The admin API's own metrics (``app.request_metrics``): every answer counted
by route and status, unknown routes folded into one series, and /metrics
showing them even while the engine's snapshot does not change."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from api_support import ADMIN_HEADERS, READ_HEADERS, ClientFactory, TestClient, small_settings
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from app import AdminServer, start_admin_server
from app.request_metrics import UNROUTED
from app.state import metrics_format
from kvoffload import CPUBackend, PolicyOffloadingManager
from kvoffload.runtime import HostedManager

REQUESTS = "kvoffload_api_requests_total"
DURATION = "kvoffload_api_request_duration_seconds"


def scrape(client: TestClient) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {sorted labels: value} of one GET /metrics."""
    answer = client.get("/metrics", headers=READ_HEADERS)
    assert answer.status_code == 200
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def requests(samples: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, float]:
    """'NAME OUTCOME' -> count."""
    return {
        f"{dict(labels)['name']} {dict(labels)['outcome']}": value
        for labels, value in samples.get(REQUESTS, {}).items()
    }


def test_every_answer_is_counted_by_route_and_status(client: TestClient) -> None:
    client.get("/v1/cache", headers=READ_HEADERS)
    client.get("/v1/cache")  # no read token
    client.put("/v1/policy", json={"policy": "arc"})  # no admin token
    client.put("/v1/policy", json={"policy": "arc"}, headers=READ_HEADERS)  # not admin
    client.put("/v1/policy", json={"policy": "arc"}, headers=ADMIN_HEADERS)
    client.put("/v1/policy", json={"policy": "nope"}, headers=ADMIN_HEADERS)
    client.get("/v1/events", params={"limit": "abc"}, headers=READ_HEADERS)
    client.head("/v1/policy", headers=READ_HEADERS)
    # the limits' own answer (before any route) is counted under the route
    client.put("/v1/policy", content=b"x" * (2 << 20), headers=ADMIN_HEADERS)
    counted = requests(scrape(client))
    assert counted == {
        "GET /v1/cache 200": 1,
        "GET /v1/cache 401": 1,
        "PUT /v1/policy 401": 1,
        "PUT /v1/policy 403": 1,
        "PUT /v1/policy 200": 1,
        "PUT /v1/policy 422": 1,
        "GET /v1/events 422": 1,
        "HEAD /v1/policy 200": 1,
        "PUT /v1/policy 413": 1,
    }
    # a scrape is counted too, once it is answered: the next rendering
    # (past the cache's age bound, 0.1 s) shows it
    time.sleep(0.15)
    assert requests(scrape(client))["GET /metrics 200"] == 1


def test_paths_and_methods_no_route_serves_are_one_series(client: TestClient) -> None:
    for k in range(20):
        client.get(f"/v1/cache/{k}", headers=READ_HEADERS)
        client.get(f"/nothing-{k}?token=secret-{k}")
    client.delete("/v1/cache", headers=ADMIN_HEADERS)  # a path served, not this method
    client.request("BREW", "/v1/policy", headers=ADMIN_HEADERS)
    samples = scrape(client)
    assert requests(samples) == {f"{UNROUTED} 404": 40, f"{UNROUTED} 405": 2}
    names = {dict(labels)["name"] for labels in samples[f"{DURATION}_count"]}
    assert names == {UNROUTED}
    assert samples[f"{DURATION}_count"][(("name", UNROUTED),)] == 42


def test_durations_are_counted_with_the_requests(client: TestClient) -> None:
    for _ in range(3):
        client.get("/v1/policy", headers=READ_HEADERS)
    samples = scrape(client)
    labels = (("name", "GET /v1/policy"),)
    assert samples[f"{DURATION}_count"][labels] == 3
    assert samples[f"{DURATION}_sum"][labels] > 0
    buckets = {
        dict(k)["le"]: v
        for k, v in samples[f"{DURATION}_bucket"].items()
        if dict(k)["name"] == "GET /v1/policy"
    }
    assert buckets["+Inf"] == 3


def test_metrics_of_an_idle_engine_still_show_the_api_requests(
    make_client: ClientFactory,
) -> None:
    # the /metrics cache reused a rendering for as long as the engine's
    # snapshot was the same object (a paused engine): the API counters would
    # have stayed at their first value
    client = make_client()
    assert client.post("/v1/runtime:pause", headers=ADMIN_HEADERS).status_code == 200
    seen = []
    for _ in range(3):
        time.sleep(0.15)  # past the cache's age bound (0.1 s)
        seen.append(requests(scrape(client)).get("GET /metrics 200", 0))
    assert seen == [0, 1, 2]


def test_the_api_metrics_are_on_a_hosts_registry(make_client: ClientFactory) -> None:
    # one registry: what a host exports (and the OTLP bridge reads) has them
    client = make_client()
    client.get("/livez")
    registry = client.app.state.service.registry  # type: ignore[attr-defined]
    value = registry.get_sample_value(REQUESTS, {"name": "GET /livez", "outcome": "200"})
    assert value == 1


def hosted_manager() -> HostedManager:
    manager = PolicyOffloadingManager(
        CPUBackend(block_size=16, num_blocks=32), policy="lru", enable_events=True
    )
    return HostedManager(manager)


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float | None:
    """``name{labels}`` of ``registry``, once it is there (polled briefly)."""
    deadline = time.monotonic() + 5
    while (value := registry.get_sample_value(name, labels)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    return value


def test_a_host_passing_its_own_registry_gets_the_api_metrics() -> None:
    # docs/observability.md: start_admin_server(registry=...) gets them too
    registry = CollectorRegistry()
    server = start_admin_server(hosted_manager(), small_settings(port=0), registry=registry)
    try:
        assert server.registry is registry
        assert httpx.get(f"{server.url}/livez", timeout=5).status_code == 200
        labels = {"name": "GET /livez", "outcome": "200"}
        assert sample(registry, REQUESTS, labels) == 1
        assert sample(registry, f"{DURATION}_count", {"name": "GET /livez"}) == 1
    finally:
        server.stop()


@pytest.fixture
def hosted_server() -> Iterator[AdminServer]:
    server = start_admin_server(hosted_manager(), small_settings(port=0))
    try:
        yield server
    finally:
        server.stop()


def test_an_event_stream_is_counted_and_timed_as_it_opens(hosted_server: AdminServer) -> None:
    # docs/observability.md: the duration runs to the answer's status line,
    # and a stream is counted and timed as it opens, not when it ends
    registry, name = hosted_server.registry, "GET /v1/events/stream"
    with (
        httpx.Client(base_url=hosted_server.url, headers=READ_HEADERS, timeout=10.0) as http,
        http.stream("GET", "/v1/events/stream") as stream,  # the live tail: it does not end
    ):
        assert stream.status_code == 200
        opened = time.monotonic()
        assert sample(registry, REQUESTS, {"name": name, "outcome": "200"}) == 1
        assert sample(registry, f"{DURATION}_count", {"name": name}) == 1
        time.sleep(0.5)  # open a while longer: what it was timed at does not grow
        took = registry.get_sample_value(f"{DURATION}_sum", {"name": name})
        assert took is not None and 0 < took < time.monotonic() - opened
        assert not stream.is_closed  # still open
        assert registry.get_sample_value(REQUESTS, {"name": name, "outcome": "200"}) == 1


# -- OpenMetrics and exemplars ---------------------------------------------------------

#: what Prometheus 3 sends when it scrapes
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


@pytest.mark.parametrize(
    ("accept", "fmt"),
    [
        (None, "text"),
        ("", "text"),
        ("*/*", "text"),
        ("text/plain", "text"),
        (PROMETHEUS_ACCEPT, "openmetrics"),
        ("application/openmetrics-text", "openmetrics"),
        ("application/openmetrics-text;q=0.1,text/plain;q=0.9", "text"),
        ("text/plain;q=0.5, application/openmetrics-text;q=0.5", "openmetrics"),
        ("application/openmetrics-text;q=0", "text"),
        ("application/openmetrics-text;q=abc", "text"),
    ],
)
def test_metrics_format_follows_the_accept_header(accept: str | None, fmt: str) -> None:
    assert metrics_format(accept) == fmt


def test_prometheus_gets_openmetrics_with_the_traces_of_sampled_steps() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    from app.main import create_app
    from app.telemetry import Telemetry

    spans = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    app = create_app(small_settings(), telemetry_factory=lambda: Telemetry(provider))
    with TestClient(app) as client:
        deadline = time.monotonic() + 20
        while not [s for s in spans.get_finished_spans() if s.name == "kvoffload.step"]:
            assert time.monotonic() < deadline, "no step span"
            time.sleep(0.05)
        om = client.get("/metrics", headers={**READ_HEADERS, "Accept": PROMETHEUS_ACCEPT})
        text = client.get("/metrics", headers=READ_HEADERS)
    assert om.status_code == text.status_code == 200
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert text.headers["content-type"].startswith("text/plain")
    assert om.text.endswith("# EOF\n") and "trace_id" not in text.text
    steps = {
        format(s.context.trace_id, "032x")
        for s in spans.get_finished_spans()
        if s.name == "kvoffload.step"
    }
    exemplars = [
        sample.exemplar
        for family in openmetrics_families(om.text)
        if family.name == "kvoffload_runtime_step_duration_seconds"
        for sample in family.samples
        if sample.exemplar
    ]
    assert exemplars and {e.labels["trace_id"] for e in exemplars} <= steps
