"""The event log over HTTP: cursor reads, `missed`, drain, and the SSE tail."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from api_support import ADMIN_HEADERS, READ_HEADERS, ClientFactory, TestClient
from prometheus_client.parser import text_string_to_metric_families


def pause(client: TestClient) -> None:
    assert client.post("/v1/runtime:pause", headers=ADMIN_HEADERS).status_code == 200


def last_seq(client: TestClient) -> int:
    seq: int = client.get("/v1/events?limit=1", headers=READ_HEADERS).json()["last_seq"]
    return seq


def wait_for_events(client: TestClient, n: int) -> None:
    deadline = time.monotonic() + 10
    while last_seq(client) < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def event_metrics(text: str) -> dict[str, float]:
    """The kvoffload_events_* samples of a /metrics answer."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvoffload_events_")
    }


def parse_sse(lines: list[str]) -> list[dict[str, Any]]:
    """SSE blocks as dicts (field -> value); comment lines under ':'."""
    events: list[dict[str, Any]] = []
    block: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if block:
                events.append(block)
            block = {}
        elif line.startswith(":"):
            block.setdefault(":", []).append(line[1:].strip())
        else:
            name, _, value = line.partition(":")
            block[name] = value.removeprefix(" ")
    if block:
        events.append(block)
    return events


def read_stream(client: TestClient, url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    with client.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(list(r.iter_lines()))


# --------------------------------------------------------------------------- read


def test_read_after_cursor_is_non_destructive(client: TestClient) -> None:
    wait_for_events(client, 20)
    pause(client)
    top = last_seq(client)
    page = client.get(f"/v1/events?after_seq={top - 10}&limit=4", headers=READ_HEADERS).json()
    seqs = [e["seq"] for e in page["events"]]
    assert seqs == list(range(top - 9, top - 5))
    assert page["missed"] == 0
    assert page["next_after_seq"] == top - 6
    again = client.get(f"/v1/events?after_seq={top - 10}&limit=4", headers=READ_HEADERS).json()
    assert again == page
    rest = client.get(f"/v1/events?after_seq={page['next_after_seq']}", headers=READ_HEADERS).json()
    assert [e["seq"] for e in rest["events"]] == list(range(top - 5, top + 1))
    assert rest["next_after_seq"] == top


def test_event_records_are_typed(client: TestClient) -> None:
    wait_for_events(client, 5)
    client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc"})
    page = client.get("/v1/events?limit=10000", headers=READ_HEADERS).json()
    kinds = {e["kind"] for e in page["events"]}
    assert "stored" in kinds
    assert "policy_switched" in kinds
    stored = next(e for e in page["events"] if e["kind"] == "stored")
    assert stored["medium"] == "CPU"
    assert stored["block_size"] == 64
    assert all(len(h) == 32 and int(h, 16) >= 0 for h in stored["block_hashes"])
    switched = next(e for e in page["events"] if e["kind"] == "policy_switched")
    assert switched["detail"] == {"from": "lru", "to": "arc"}


def test_cursor_that_fell_off_the_ring_reports_missed(make_client: ClientFactory) -> None:
    client = make_client(event_log_capacity=16)
    wait_for_events(client, 100)
    pause(client)
    top = last_seq(client)
    page = client.get("/v1/events?after_seq=0&limit=5", headers=READ_HEADERS).json()
    first = top - 16 + 1
    assert page["missed"] == first - 1
    assert [e["seq"] for e in page["events"]] == list(range(first, first + 5))
    assert page["next_after_seq"] == first + 4
    # reading on from there misses nothing more
    follow = client.get(
        f"/v1/events?after_seq={page['next_after_seq']}", headers=READ_HEADERS
    ).json()
    assert follow["missed"] == 0
    events = client.get("/v1/cache", headers=READ_HEADERS).json()["events"]
    assert events["overwritten"] == page["missed"]  # nothing drained: all overwritten
    assert events["missed"] == 0  # a read from the start is no consumer losing records


def test_drain_removes_and_returns_oldest(client: TestClient) -> None:
    wait_for_events(client, 30)
    pause(client)
    before = client.get("/v1/events?limit=10000", headers=READ_HEADERS).json()["events"]
    drained = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json={"limit": 10}).json()
    assert drained["events"] == before[:10]
    assert drained["remaining"] == len(before) - 10
    page = client.get("/v1/events?after_seq=0&limit=10000", headers=READ_HEADERS).json()
    assert page["events"] == before[10:]
    assert page["missed"] == before[10]["seq"] - 1
    everything = client.post("/v1/events:drain", headers=ADMIN_HEADERS).json()
    assert everything["events"] == before[10:]
    assert everything["remaining"] == 0
    empty = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json={}).json()
    assert empty == {"events": [], "remaining": 0}


def test_drain_and_misses_show_at_once_while_paused(make_client: ClientFactory) -> None:
    # issue 18, defect 1: /metrics and /v1/cache read the event log's counts
    # from the engine's snapshot (published after steps and commands only)
    # and reused their renderings while it was the same snapshot, so after a
    # drain both said drained 0 for as long as the engine stayed paused
    client = make_client(event_log_capacity=64)
    wait_for_events(client, 100)
    pause(client)
    before = client.get("/v1/cache", headers=READ_HEADERS).json()["events"]
    client.get("/metrics", headers=READ_HEADERS)  # rendered, so that a stale one could be reused
    drained = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json={"limit": 40}).json()
    assert len(drained["events"]) == 40
    page = client.get("/v1/events?after_seq=1&limit=1", headers=READ_HEADERS).json()
    assert page["missed"] > 0
    events = client.get("/v1/cache", headers=READ_HEADERS).json()["events"]
    assert events["drained"] == before["drained"] + 40
    assert events["buffered"] == drained["remaining"] == before["buffered"] - 40
    assert events["missed"] == page["missed"]
    assert events["appended"] == events["overwritten"] + events["drained"] + events["buffered"]
    exposed = event_metrics(client.get("/metrics", headers=READ_HEADERS).text)
    assert exposed["kvoffload_events_drained_total"] == events["drained"]
    assert exposed["kvoffload_events_buffered"] == events["buffered"]
    assert exposed["kvoffload_events_overwritten_total"] == events["overwritten"]
    assert exposed["kvoffload_events_appended_total"] == events["appended"]
    # a reader's miss is a counter: /metrics shows it within its 0.1 s reuse bound
    deadline = time.monotonic() + 5
    while exposed["kvoffload_events_missed_total"] != events["missed"]:
        assert time.monotonic() < deadline, exposed
        time.sleep(0.05)
        exposed = event_metrics(client.get("/metrics", headers=READ_HEADERS).text)


def test_drain_through_seq_loses_nothing_when_repeated(client: TestClient) -> None:
    # a consumer that reads, handles, then drains through the last seq it
    # handled can repeat a drain whose answer it lost: nothing more goes
    wait_for_events(client, 30)
    pause(client)
    page = client.get("/v1/events?limit=5", headers=READ_HEADERS).json()
    handled = page["next_after_seq"]
    body = {"through_seq": handled}
    first = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json=body).json()
    assert first["events"] == page["events"]
    again = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json=body).json()
    assert again["events"] == []
    assert again["remaining"] == first["remaining"]
    rest = client.get(f"/v1/events?after_seq={handled}", headers=READ_HEADERS).json()
    assert rest["missed"] == 0  # the reader's cursor lost nothing
    top = last_seq(client)
    ahead = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json={"through_seq": top + 1})
    assert ahead.status_code == 409
    assert ahead.json()["error"]["code"] == "cursor_ahead"
    assert ahead.json()["error"]["last_seq"] == top
    for bad in (-1, "3", True, 2**53, 1.5):
        r = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json={"through_seq": bad})
        assert r.status_code == 422, bad
    events = client.get("/v1/cache", headers=READ_HEADERS).json()["events"]
    assert events["drained"] == len(page["events"])  # the refused ones drained nothing


def test_a_drain_whose_client_has_gone_drains_nothing(client: TestClient) -> None:
    # the client timed out (or reset the connection) before the drain was
    # made: it drained records nobody received. Driven at the ASGI level, on
    # the client's own loop: the request arrives whole, then the disconnect.
    wait_for_events(client, 10)
    pause(client)
    before = client.get("/v1/cache", headers=READ_HEADERS).json()["events"]
    body = b'{"limit": 5}'
    incoming: list[dict[str, Any]] = [
        {"type": "http.request", "body": body, "more_body": False},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if len(incoming) > 1 else incoming[0]

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/events:drain",
        "raw_path": b"/v1/events:drain",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", ADMIN_HEADERS["Authorization"].encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "state": {},
    }
    assert client.portal is not None
    client.portal.call(client.app, scope, receive, send)
    assert sent == []  # nobody to answer
    after = client.get("/v1/cache", headers=READ_HEADERS).json()["events"]
    assert (after["drained"], after["buffered"]) == (before["drained"], before["buffered"])
    metrics = client.get("/metrics", headers=READ_HEADERS).text
    assert (
        'kvoffload_api_requests_total{name="POST /v1/events:drain",outcome="closed"} 1.0' in metrics
    )


def test_drain_limit_is_bounded(client: TestClient) -> None:
    for body in ({"limit": 0}, {"limit": 10_001}, {"limit": "all"}, {"max": 3}):
        r = client.post("/v1/events:drain", headers=ADMIN_HEADERS, json=body)
        assert r.status_code == 422, body
        assert r.json()["error"]["code"] == "invalid_request"


# --------------------------------------------------------------------------- stream


def test_stream_ids_are_seqs_and_resume_with_last_event_id(client: TestClient) -> None:
    wait_for_events(client, 20)
    pause(client)  # nothing new arrives: the stream content is exact
    top = last_seq(client)
    start = top - 10
    first = read_stream(client, f"/v1/events/stream?after_seq={start}&limit=3", READ_HEADERS)
    assert first[0] == {"retry": "2000"}
    records = [e for e in first if "id" in e]
    assert [int(e["id"]) for e in records] == [start + 1, start + 2, start + 3]
    for e in records:
        data = json.loads(e["data"])
        assert data["seq"] == int(e["id"])
        assert e["event"] == data["kind"]
    # reconnect after the second record: the larger cursor wins, the header's
    resumed = read_stream(
        client,
        "/v1/events/stream?after_seq=0&limit=3",
        {**READ_HEADERS, "Last-Event-ID": str(start + 2)},
    )
    assert [int(e["id"]) for e in resumed if "id" in e] == [start + 3, start + 4, start + 5]
    # ... or after_seq's, when it is the larger
    ahead = read_stream(
        client,
        f"/v1/events/stream?after_seq={start + 5}&limit=2",
        {**READ_HEADERS, "Last-Event-ID": str(start + 1)},
    )
    assert [int(e["id"]) for e in ahead if "id" in e] == [start + 6, start + 7]


def test_stream_reports_missed_records(make_client: ClientFactory) -> None:
    client = make_client(event_log_capacity=16)
    wait_for_events(client, 50)
    pause(client)
    top = last_seq(client)
    events = read_stream(client, "/v1/events/stream?after_seq=0&limit=2", READ_HEADERS)
    missed = [e for e in events if e.get("event") == "missed"]
    assert len(missed) == 1
    assert json.loads(missed[0]["data"]) == {"missed": top - 16, "after_seq": 0}
    assert [int(e["id"]) for e in events if "id" in e] == [top - 15, top - 14]


def test_stream_tails_live_events(client: TestClient) -> None:
    top = last_seq(client)
    with client.stream("GET", f"/v1/events/stream?after_seq={top}", headers=READ_HEADERS) as r:
        seen: list[int] = []
        for line in r.iter_lines():
            if line.startswith("id: "):
                seen.append(int(line[4:]))
            if len(seen) == 5:
                break  # the client goes away mid-stream
    assert seen == list(range(top + 1, top + 6))
    # the service is still fine after the disconnect
    assert client.get("/v1/cache", headers=READ_HEADERS).status_code == 200


def test_stream_heartbeats_and_ends_on_shutdown(make_client: ClientFactory) -> None:
    client = make_client(sse_heartbeat=0.05)
    pause(client)
    top = last_seq(client)
    stopping: threading.Event = client.app.state.service.stopping  # type: ignore[attr-defined]
    timer = threading.Timer(0.4, stopping.set)
    timer.start()
    try:
        t0 = time.monotonic()
        events = read_stream(client, f"/v1/events/stream?after_seq={top}", READ_HEADERS)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 5
    heartbeats = [c for e in events for c in e.get(":", []) if c == "heartbeat"]
    assert len(heartbeats) >= 2
    assert not [e for e in events if "id" in e]
    # once stopping, the service reports not ready
    assert client.get("/readyz").status_code == 503


def test_stream_cursor_ahead_of_log_starts_at_its_end(client: TestClient) -> None:
    pause(client)
    top = last_seq(client)
    with client.stream(
        "GET", "/v1/events/stream", headers={**READ_HEADERS, "Last-Event-ID": str(top + 1000)}
    ) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith(": cursor"):
                break
    assert f"ahead of the log (last seq {top})" in lines[-1]


def test_stream_rejects_bad_last_event_id(client: TestClient) -> None:
    r = client.get("/v1/events/stream", headers={**READ_HEADERS, "Last-Event-ID": "abc"})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_request"
