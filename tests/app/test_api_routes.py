"""Every route of the admin API through the real app (lifespan, engine, registry)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from api_support import ADMIN_HEADERS, READ_HEADERS, ClientFactory, TestClient, small_settings

from app.engine_setup import engine_config, load_workload
from app.main import create_app
from app.settings import Settings
from kvoffload.policies import available_policies
from kvoffload.runtime import CommandResult, Engine, EngineObserver

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def wait_for(client: TestClient, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
    """Poll /v1/cache until ``predicate(view)`` holds; returns that view."""
    deadline = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = client.get("/v1/cache", headers=READ_HEADERS).json()
        if predicate(view):
            return view
        assert time.monotonic() < deadline, f"condition not met; last view {view}"
        time.sleep(0.01)


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


# --------------------------------------------------------------------------- cache


def test_cache_view_is_one_consistent_snapshot(client: TestClient) -> None:
    view = wait_for(client, lambda v: v["runtime"]["steps"] > 5)
    blocks = view["blocks"]
    assert blocks["capacity"] == 32
    assert blocks["used"] + blocks["free"] == blocks["capacity"]
    assert view["policy"] == "lru"
    assert view["policy_version"] == 1
    assert view["state"] == "running"
    assert view["arc"] is None
    assert view["lists"] == {"lru": blocks["used"]}
    assert view["ghost_lists"] == {}
    # block counts name their unit: offloaded blocks, and the runtime's GPU blocks
    assert (view["block_size"], view["gpu_block_size"]) == (64, 16)
    assert "loaded_gpu_blocks" in view["runtime"]
    assert 0.0 <= view["hit_ratio"] <= 1.0
    assert view["workload"].startswith("synthetic")
    assert view["runtime"]["verify_failures"] == 0
    assert view["events"]["capacity"] == 10_000
    counters = view["counters"]
    assert counters["lookup_blocks"] >= counters["hit_blocks"]


@pytest.mark.parametrize("policy", ["arc", "kvarc"])
def test_cache_view_shows_arc_lists_and_target(make_client: ClientFactory, policy: str) -> None:
    client = make_client(policy=policy)
    view = wait_for(client, lambda v: v["blocks"]["used"] > 0)
    assert view["policy"] == policy
    arc = view["arc"]
    assert arc is not None
    assert set(arc) == {"t1", "t2", "b1", "b2", "target_t1_size"}
    # resident lists apart from ghost lists (hashes of evicted blocks, no data)
    assert {k: arc[k] for k in ("t1", "t2")} == view["lists"]
    assert {k: arc[k] for k in ("b1", "b2")} == view["ghost_lists"]
    assert sum(view["lists"].values()) == view["blocks"]["used"]  # stores in flight included
    assert 0 <= arc["target_t1_size"] <= view["blocks"]["capacity"]


# --------------------------------------------------------------------------- policy


def test_get_policy_lists_available(client: TestClient) -> None:
    body = client.get("/v1/policy", headers=READ_HEADERS).json()
    assert body == {"policy": "lru", "version": 1, "available": list(available_policies())}


def test_put_policy_switches_and_reports_step(client: TestClient) -> None:
    before = client.get("/v1/cache", headers=READ_HEADERS).json()["step"]
    r = client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["policy"] == "arc"
    assert body["previous_policy"] == "lru"
    assert body["version"] == 2
    assert body["applied_at_step"] >= before
    assert client.get("/v1/policy", headers=READ_HEADERS).json()["version"] == 2
    view = client.get("/v1/cache", headers=READ_HEADERS).json()
    assert view["policy"] == "arc"
    assert view["arc"] is not None


def test_put_policy_with_stale_version_is_409_naming_current(client: TestClient) -> None:
    ok = client.put(
        "/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc", "expected_version": 1}
    )
    assert ok.status_code == 200
    stale = client.put(
        "/v1/policy", headers=ADMIN_HEADERS, json={"policy": "lru", "expected_version": 1}
    )
    error = assert_error(stale, 409, "version_conflict")
    assert error["current_version"] == 2
    assert error["expected_version"] == 1
    assert "2" in error["message"]
    assert client.get("/v1/policy", headers=READ_HEADERS).json()["policy"] == "arc"


def test_put_unknown_policy_is_422_listing_valid_ones(client: TestClient) -> None:
    r = client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "fifo"})
    error = assert_error(r, 422, "unknown_policy")
    assert error["valid_policies"] == list(available_policies())
    for name in available_policies():
        assert name in error["message"]


def test_validate_is_a_dry_run(client: TestClient) -> None:
    r = client.post("/v1/policy:validate", headers=READ_HEADERS, json={"policy": "arc"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "valid": True,
        "policy": "arc",
        "current_policy": "lru",
        "current_version": 1,
    }
    assert client.get("/v1/policy", headers=READ_HEADERS).json()["version"] == 1
    bad = client.post("/v1/policy:validate", headers=READ_HEADERS, json={"policy": "mru"})
    assert assert_error(bad, 422, "unknown_policy")["valid_policies"] == list(available_policies())
    stale = client.post(
        "/v1/policy:validate", headers=READ_HEADERS, json={"policy": "arc", "expected_version": 7}
    )
    assert assert_error(stale, 409, "version_conflict")["current_version"] == 1


def test_colon_routes_do_not_collide_with_plain_ones(client: TestClient) -> None:
    # "/v1/policy:validate" must reach the validate route, not 405 from "/v1/policy".
    assert (
        client.post("/v1/policy:validate", json={"policy": "lru"}, headers=READ_HEADERS).status_code
        == 200
    )
    assert_error(
        client.post("/v1/policy", headers=ADMIN_HEADERS, json={}), 405, "method_not_allowed"
    )
    assert_error(client.get("/v1/policy:validate", headers=READ_HEADERS), 405, "method_not_allowed")
    assert_error(client.post("/v1/policy:nope", headers=ADMIN_HEADERS), 404, "not_found")


# --------------------------------------------------------------------------- runtime


def test_pause_and_resume(client: TestClient) -> None:
    r = client.post("/v1/runtime:pause", headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "pause"
    assert r.json()["state"] == "paused"
    step = client.get("/v1/cache", headers=READ_HEADERS).json()["step"]
    time.sleep(0.1)
    view = client.get("/v1/cache", headers=READ_HEADERS).json()
    assert view["state"] == "paused"
    assert view["step"] == step
    # idempotent
    assert client.post("/v1/runtime:pause", headers=ADMIN_HEADERS).json()["state"] == "paused"
    r = client.post("/v1/runtime:resume", headers=ADMIN_HEADERS)
    assert r.status_code == 200
    assert r.json()["state"] == "running"
    wait_for(client, lambda v: v["step"] > step)


def test_reset_needs_confirmation(client: TestClient) -> None:
    wait_for(client, lambda v: v["blocks"]["used"] > 0)
    # anything but {"confirm": true} is refused as unconfirmed (docs/api.md)
    for body in ({}, None, {"confirm": False}):
        refused = client.post("/v1/cache:reset", headers=ADMIN_HEADERS, json=body)
        error = assert_error(refused, 422, "confirmation_required")
        assert '"confirm": true' in error["message"]
    assert client.get("/v1/cache", headers=READ_HEADERS).json()["blocks"]["used"] > 0


def test_reset_with_confirmation_evicts(client: TestClient) -> None:
    wait_for(client, lambda v: v["blocks"]["used"] > 0)
    client.post("/v1/runtime:pause", headers=ADMIN_HEADERS)
    r = client.post("/v1/cache:reset", headers=ADMIN_HEADERS, json={"confirm": True})
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "reset"
    view = client.get("/v1/cache", headers=READ_HEADERS).json()
    # paused: only blocks pinned or in flight may survive the reset
    assert view["blocks"]["used"] == view["blocks"]["pinned"] + view["blocks"]["in_flight"]
    assert view["counters"]["lookups"] > 0  # counters survive


# --------------------------------------------------------------------------- health, metrics


def test_livez_and_readyz(client: TestClient) -> None:
    assert client.get("/livez").json()["status"] == "ok"
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json()["state"] == "running"


def test_a_replay_that_finished_is_ready(tmp_path: Path) -> None:
    # docs/api.md: /readyz 200 "finished" for a non-looping replay, and
    # kvoffload_runtime_up 1 (the engine-stopped alert must not page)
    lines = TRACE.read_text().splitlines()[:20]
    trace = tmp_path / "short.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    app = create_app(small_settings(workload=str(trace), loop=False))
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while client.get("/readyz").json().get("state") != "finished":
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.02)
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json()["status"] == "ok", r.json()
        assert "kvoffload_runtime_up 1.0" in client.get("/metrics", headers=READ_HEADERS).text


def test_readyz_is_503_when_engine_stopped(client: TestClient) -> None:
    client.app.state.service.target.stop(5.0)  # type: ignore[attr-defined]
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["state"] == "stopped"
    # a command to a stopped engine is a clean 503, not a hang
    assert_error(
        client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc"}),
        503,
        "engine_stopped",
    )


def test_a_service_not_started_is_503_not_ready() -> None:
    # no `with`: the lifespan never ran, so there is no engine and no service
    client = TestClient(create_app(small_settings()))
    for method, path, headers, body in (
        ("GET", "/v1/policy", READ_HEADERS, None),
        ("GET", "/v1/cache", READ_HEADERS, None),  # the cached reads pass it on
        ("PUT", "/v1/policy", ADMIN_HEADERS, {"policy": "arc"}),
        ("POST", "/v1/runtime:pause", ADMIN_HEADERS, None),
    ):
        r = client.request(method, path, headers=headers, json=body)
        assert_error(r, 503, "not_ready")


def test_a_bug_is_a_500_internal_error_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = create_app(small_settings())

    async def broken() -> None:
        raise RuntimeError("a bug in a route")

    app.add_api_route("/v1/broken", broken, methods=["GET"])
    with TestClient(app, raise_server_exceptions=False) as client:
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            r = client.get("/v1/broken", headers=READ_HEADERS)
    error = assert_error(r, 500, "internal_error")
    assert set(error) == {"code", "message"}
    assert "a bug in a route" not in r.text  # the traceback goes to the log, not the client
    assert "the error is in its log" in error["message"]
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1, [record.getMessage() for record in errors]
    (record,) = errors
    assert "GET /v1/broken" in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)
    assert "a bug in a route" in caplog.text  # the traceback is in the log


def test_command_timeout_is_504() -> None:
    class StuckEngine(Engine):
        def resume(self) -> Future[CommandResult]:
            return Future()  # queued, never applied

    def factory(settings: Settings, observers: Sequence[EngineObserver]) -> Engine:
        return StuckEngine(engine_config(settings), load_workload(settings), observers)

    app = create_app(small_settings(command_timeout=0.2), engine_factory=factory)
    with TestClient(app) as client:
        r = client.post("/v1/runtime:resume", headers=ADMIN_HEADERS)
        assert "within 0.2 s" in assert_error(r, 504, "engine_timeout")["message"]
        # the service stays responsive
        assert client.get("/v1/cache", headers=READ_HEADERS).status_code == 200


def test_metrics_come_from_the_apps_own_registry(make_client: ClientFactory) -> None:
    from prometheus_client import REGISTRY

    a = make_client()
    b = make_client(policy="arc")
    text_a = a.get("/metrics", headers=READ_HEADERS).text
    text_b = b.get("/metrics", headers=READ_HEADERS).text
    assert 'kvoffload_policy_info{policy="lru"} 1.0' in text_a
    assert 'kvoffload_policy_info{policy="arc"} 1.0' in text_b
    assert "kvoffload_transfer_jobs_total" in text_a
    assert a.get("/metrics", headers=READ_HEADERS).headers["content-type"].startswith("text/plain")
    assert REGISTRY.get_sample_value("kvoffload_policy_info", {"policy": "lru"}) is None


def test_openapi_and_docs(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in (
        "/v1/cache",
        "/v1/cache:reset",
        "/v1/policy",
        "/v1/policy:validate",
        "/v1/events",
        "/v1/events:drain",
        "/v1/events/stream",
        "/v1/runtime:pause",
        "/v1/runtime:resume",
        "/livez",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    put = paths["/v1/policy"]["put"]
    assert {"409", "422", "401", "403"} <= set(put["responses"])
    docs = client.get("/docs")
    assert docs.status_code == 200
    # README: the page needs a CDN, /openapi.json does not
    assert "https://cdn.jsdelivr.net/" in docs.text and "/openapi.json" in docs.text


# --------------------------------------------------------------------------- errors


def test_unknown_query_parameters_are_refused_after_auth(client: TestClient) -> None:
    typo = client.get("/v1/events?limt=5", headers=READ_HEADERS)
    error = assert_error(typo, 422, "invalid_request")
    assert error["message"] == (
        "unknown query parameter 'limt'; this route takes: after_seq, limit"
    )
    none_taken = client.get("/v1/cache?verbose=1", headers=READ_HEADERS)
    assert assert_error(none_taken, 422, "invalid_request")["message"].endswith("takes: none")
    # who is asking is decided first
    assert_error(client.get("/v1/cache?verbose=1"), 401, "missing_token")
    # a known one passes, and so does an empty query string
    assert client.get("/v1/events?limit=1", headers=READ_HEADERS).status_code == 200
    assert client.get("/v1/cache?", headers=READ_HEADERS).status_code == 200


def test_errors_are_json_and_4xx(client: TestClient) -> None:
    malformed = client.put(
        "/v1/policy",
        headers={**ADMIN_HEADERS, "content-type": "application/json"},
        content=b'{"policy": ',
    )
    assert_error(malformed, 400, "malformed_json")
    wrong_type = client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": 3})
    assert_error(wrong_type, 422, "invalid_request")
    extra = client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "lru", "force": True})
    assert_error(extra, 422, "invalid_request")
    negative = client.put(
        "/v1/policy", headers=ADMIN_HEADERS, json={"policy": "lru", "expected_version": -1}
    )
    assert_error(negative, 422, "invalid_request")
    huge = client.put(
        "/v1/policy", headers=ADMIN_HEADERS, json={"policy": "lru", "expected_version": 10**30}
    )
    assert_error(huge, 422, "invalid_request")
    too_many = client.get("/v1/events?limit=10001", headers=READ_HEADERS)
    error = assert_error(too_many, 422, "invalid_request")
    assert "10000" in error["message"]
    assert error["issues"][0]["loc"] == ["query", "limit"]
    not_int = client.get("/v1/events?after_seq=abc", headers=READ_HEADERS)
    assert_error(not_int, 422, "invalid_request")
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    wrong_method = client.delete("/v1/policy", headers=ADMIN_HEADERS)
    assert_error(wrong_method, 405, "method_not_allowed")
    assert set(wrong_method.headers["allow"].split(", ")) == {"GET", "HEAD", "PUT"}


def test_metrics_follow_the_snapshot(client: TestClient) -> None:
    client.post("/v1/runtime:pause", headers=ADMIN_HEADERS)
    first = client.get("/metrics", headers=READ_HEADERS).text
    assert client.get("/metrics", headers=READ_HEADERS).text == first  # same snapshot
    client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc"})
    after = client.get("/metrics", headers=READ_HEADERS).text
    assert 'kvoffload_policy_info{policy="arc"} 1.0' in after


def test_docs_list_every_setting_and_route(client: TestClient) -> None:
    from pathlib import Path

    from app.flags import ENV_ONLY, env_name, flag_name

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for name in Settings.model_fields:
        assert f"`{env_name(name)}`" in text, name
        if name not in ENV_ONLY:
            assert flag_name(name) in text, name
    for path in client.get("/openapi.json").json()["paths"]:
        assert f"`{path}" in text, path
