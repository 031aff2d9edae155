"""What a public service needs, against a real `kvoffload serve` on loopback:
abandoned streams freed, bodies capped and auth decided before them, request
targets routed as written, reads that follow writes, stream slots and the
live-tail default, a deadline on request headers, and start-up settings that
fail in one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served import (
    ADMIN,
    READ,
    READ_TOKEN,
    ROOT,
    TOKEN,
    Served,
    free_port,
    raw_request,
    serve,
    served,
    status_of,
    wait_ready,
)

pytestmark = pytest.mark.slow

#: every route, as (method, path, body); answered promptly whatever streams do
ROUTES = [
    ("GET", "/livez", None),
    ("GET", "/readyz", None),
    ("GET", "/v1/cache", None),
    ("GET", "/v1/policy", None),
    ("PUT", "/v1/policy", {"policy": "arc"}),
    ("POST", "/v1/policy:validate", {"policy": "lru"}),
    ("GET", "/v1/events?limit=5", None),
    ("GET", "/metrics", None),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    # a few times real time: events keep coming, a core stays free
    with served("--max-event-streams", "8", "--sse-max-replay", "5", "--speed", "4") as s:
        yield s


def open_stream(port: int, target: str = "/v1/events/stream") -> tuple[socket.socket, bytes]:
    """A raw event-stream request; returns the socket and the head of the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {READ['Authorization']}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return sock, head


def stream_status(port: int) -> int:
    sock, head = open_stream(port)
    sock.close()
    return status_of(head)


# --------------------------------------------------------------------------- streams


def test_abandoned_streams_are_freed_and_every_route_answers(server: Served) -> None:
    # 100 clients open a stream and go away without a word.
    for _ in range(100):
        sock, head = open_stream(server.port)
        assert status_of(head) in (200, 503)
        sock.close()
    # Their slots come back within seconds: all 8 can be opened again.
    deadline = time.monotonic() + 10
    while True:
        socks = [open_stream(server.port) for _ in range(8)]
        statuses = [status_of(head) for _, head in socks]
        for sock, _ in socks:
            sock.close()
        if statuses == [200] * 8:
            break
        assert time.monotonic() < deadline, f"stream slots not freed: {statuses}"
        time.sleep(0.5)
    with httpx.Client(base_url=server.base, headers=ADMIN, timeout=5.0) as http:
        for method, path, body in ROUTES:
            r = http.request(method, path, json=body)
            assert r.status_code == 200, (path, r.text)


def test_stream_slots_are_capped_with_retry_after(server: Served) -> None:
    held = [open_stream(server.port) for _ in range(8)]
    try:
        assert [status_of(head) for _, head in held] == [200] * 8
        with httpx.Client(base_url=server.base, headers=READ, timeout=5.0) as http:
            full = http.get("/v1/events/stream")
            assert full.status_code == 503
            assert int(full.headers["retry-after"]) > 0
            assert full.json()["error"]["code"] == "too_many_streams"
            # everything else still answers
            assert http.get("/v1/cache").status_code == 200
    finally:
        for sock, _ in held:
            sock.close()


def read_events(response: httpx.Response, n: int) -> list[dict[str, str]]:
    """The first ``n`` events (blocks with an ``event`` field) of a stream."""
    events: list[dict[str, str]] = []
    block: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "event" in block:
                events.append(block)
                if len(events) == n:
                    break
            block = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            block[name] = value.strip()
    return events


def test_stream_without_cursor_starts_at_the_live_tail(server: Served) -> None:
    with httpx.Client(base_url=server.base, headers=READ, timeout=10.0) as http:
        before = wait_for_events(http, 20)
        with http.stream("GET", "/v1/events/stream") as r:
            assert r.status_code == 200
            events = read_events(r, 3)
    assert [e["event"] for e in events] != ["missed"] * 3
    assert all(int(e["id"]) > before for e in events), events


def wait_for_events(http: httpx.Client, n: int) -> int:
    """Wait until the log has ``n`` records; its last seq."""
    deadline = time.monotonic() + 30
    while (last := int(http.get("/v1/events?limit=1").json()["last_seq"])) < n:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return last


def test_stream_replay_is_bounded_and_the_skip_is_told(server: Served) -> None:
    with httpx.Client(base_url=server.base, headers=READ, timeout=10.0) as http:
        wait_for_events(http, 20)
        with http.stream("GET", "/v1/events/stream?after_seq=0") as r:
            first, *records = read_events(r, 4)
    assert first["event"] == "missed"
    missed = json.loads(first["data"])
    assert missed["after_seq"] == 0
    assert missed["skipped"] > 0 and missed["missed"] >= missed["skipped"]
    # replay resumes 5 records (--sse-max-replay) before the tail it saw
    assert int(records[0]["id"]) == missed["missed"] + 1


# --------------------------------------------------------------------------- bodies


def send_body(port: int, head: bytes, size: int) -> bytes:
    """Send ``head`` and then up to ``size`` bytes of body while the server
    takes them; return its answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    chunk = b"x" * (1 << 20)
    try:
        sock.sendall(head)
        sent = 0
        while sent < size:
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed
                break
            sent += len(chunk)
        answer = b""
        try:
            while part := sock.recv(65536):
                answer += part
        except OSError:
            pass
        return answer
    finally:
        sock.close()


def test_large_unauthenticated_bodies_are_refused_unread(server: Served) -> None:
    size = 300 << 20
    rss_before = server.rss_bytes()
    too_large = send_body(
        server.port,
        f"POST /no/such/path HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode(),
        size,
    )
    assert status_of(too_large) == 413
    assert b"payload_too_large" in too_large
    chunked = send_body(
        server.port,
        b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n100000\r\n",
        size,
    )
    assert status_of(chunked) == 401
    growth = server.rss_bytes() - rss_before
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB"
    # the service is fine afterwards
    assert httpx.get(f"{server.base}/livez", timeout=5).status_code == 200


def chunked_put(port: int, chunks: list[bytes], *, end: bool) -> bytes:
    """An authenticated ``PUT /v1/policy`` with ``chunks`` as its chunked body,
    ended (the last, empty chunk) if ``end``; the answer."""
    head = (
        b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" % TOKEN.encode()
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return raw_request(port, head + body + (b"0\r\n\r\n" if end else b""), timeout=5.0)


def test_a_chunked_body_is_refused_once_it_passes_the_cap() -> None:
    with served("--max-body-bytes", "4096") as s:
        # under the cap, chunked, is served
        ok = chunked_put(s.port, [b'{"policy": ', b'"arc"}', b" " * 3000], end=True)
        assert status_of(ok) == 200, ok[:300]
        # 5 KiB in 1 KiB chunks, the body never ended: refused as soon as it
        # passes 4096 bytes, not when it ends (it would wait for the body
        # timeout, 10 s, then answer 408)
        started = time.monotonic()
        refused = chunked_put(s.port, [b"{" + b" " * 1023] + [b" " * 1024] * 4, end=False)
        assert status_of(refused) == 413, refused[:300]
        assert time.monotonic() - started < 5
        head, _, body = refused.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "payload_too_large"
        assert "larger than 4096 bytes" in error["message"]
        assert httpx.get(f"{s.base}/v1/policy", headers=READ).json()["policy"] == "arc"


def test_auth_is_decided_before_the_body_is_parsed(server: Served) -> None:
    bad = b'{"policy": '
    with httpx.Client(base_url=server.base, timeout=5.0) as http:
        headers = {"content-type": "application/json"}
        assert http.put("/v1/policy", content=bad, headers=headers).status_code == 401
        assert http.put("/v1/policy", content=bad, headers={**headers, **READ}).status_code == 403
        wrong = http.put("/v1/policy", json={"policy": 3}, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        assert http.put("/v1/policy", content=bad, headers={**headers, **ADMIN}).status_code == 400
        big = http.put("/v1/policy", content=b" " * (2 << 20), headers={**headers, **ADMIN})
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "payload_too_large"


# --------------------------------------------------------------------------- targets

ODD_TARGETS = [
    "//x/v1/policy",
    "/v1/../v1/policy",
    "/v1/./policy",
    "/v1/%2e%2e/v1/policy",
    "/%2e%2e/v1/cache",
    "/v1/cache%23x",
    "/v1/cache%00",
    "/v1/cache%0a",
    "/v1/cache%0d%0aX-Injected:%201",
    "/v1/cache%",
    "/v1/cache%zz",
    "/v1/cache/",
    "/v1/policy/",
    "/v1//cache",
    "/v1/cache;x",
    "http://evil.example/v1/../v1/cache",
    "http://evil.example//v1/cache",
    "/" + "a" * 4000,
]


@pytest.mark.parametrize("target", ODD_TARGETS)
def test_odd_request_targets_are_routed_as_written(server: Served, target: str) -> None:
    answer = raw_request(
        server.port,
        f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {ADMIN['Authorization']}\r\n\r\n".encode(),
    )
    assert status_of(answer) == 404, answer[:300]
    assert b"X-Injected" not in answer.split(b"\r\n\r\n")[0]


def test_absolute_form_target_is_routed_by_its_path(server: Served) -> None:
    # RFC 9112, 3.2.2: a server must accept the absolute form; its path is
    # then routed as written (the odd ones above include absolute forms)
    answer = raw_request(
        server.port,
        f"GET http://evil.example/v1/cache HTTP/1.1\r\nHost: x\r\nAuthorization: {ADMIN['Authorization']}\r\n\r\n".encode(),
    )
    assert status_of(answer) == 200, answer[:300]


def test_a_percent_encoded_path_is_routed_decoded(server: Served) -> None:
    # docs/api.md: "/v1/c%61che is /v1/cache" (every ASGI server decodes the path)
    for target in ("/v1/c%61che", "/v1/cache"):
        answer = raw_request(
            server.port,
            f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: {READ['Authorization']}\r\n\r\n".encode(),
        )
        assert status_of(answer) == 200, (target, answer[:300])
        assert "blocks" in json.loads(answer.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize(
    "target", [b"/v1/cache\x00", b"/v1/ca\x01che", b"/v1/cache\x7f", b"/v1/cache?a=\x00"]
)
def test_control_characters_in_the_target_are_a_400(server: Served, target: bytes) -> None:
    answer = raw_request(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(answer) == 400, answer[:300]


def test_odd_query_strings_are_a_422(server: Served) -> None:
    for query in ("%00=1", "after_seq=%00", "limit=%0a", "after_seq=1&after_seq=x"):
        answer = raw_request(
            server.port,
            f"GET /v1/events?{query} HTTP/1.1\r\nHost: x\r\nAuthorization: {ADMIN['Authorization']}"
            "\r\n\r\n".encode(),
        )
        assert status_of(answer) == 422, (query, answer[:300])


# --------------------------------------------------------------------------- reads follow writes


def test_no_stale_read_after_a_switch_under_concurrent_polling(server: Served) -> None:
    stop = threading.Event()
    errors: list[str] = []

    def poll() -> None:
        with httpx.Client(base_url=server.base, headers=READ, timeout=10.0) as http:
            while not stop.is_set():
                if http.get("/v1/cache").status_code != 200:
                    errors.append("poll failed")

    pollers = [threading.Thread(target=poll, daemon=True) for _ in range(4)]
    for t in pollers:
        t.start()
    stale = []
    try:
        with httpx.Client(base_url=server.base, headers=ADMIN, timeout=10.0) as http:
            for i in range(500):
                policy = ("arc", "lru", "kvarc")[i % 3]
                switched = http.put("/v1/policy", json={"policy": policy})
                assert switched.status_code == 200, switched.text
                version = switched.json()["version"]
                view = http.get("/v1/cache").json()
                if view["policy"] != policy or view["policy_version"] < version:
                    stale.append((i, policy, view["policy"]))
                if http.get("/v1/policy").json()["policy"] != policy:
                    stale.append((i, policy, "GET /v1/policy"))
    finally:
        stop.set()
        for t in pollers:
            t.join(10)
    assert stale == []
    assert errors == []


# --------------------------------------------------------------------------- headers


def test_slow_request_headers_are_cut_off() -> None:
    with served("--header-timeout", "1") as s:
        before = api_requests(s.base)
        served_meanwhile = 0
        trickles = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(50)]
        for sock in trickles:
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
        closed: set[int] = set()
        deadline = time.monotonic() + 8
        while len(closed) < len(trickles) and time.monotonic() < deadline:
            for i, sock in enumerate(trickles):
                if i in closed:
                    continue
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                    sock.setblocking(False)
                    if sock.recv(1) == b"":
                        closed.add(i)
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(i)
                finally:
                    sock.setblocking(True)
            # while they trickle, everyone else is served
            assert httpx.get(f"{s.base}/livez", timeout=5).status_code == 200
            served_meanwhile += 1
            time.sleep(0.3)
        for sock in trickles:
            sock.close()
        assert len(closed) == len(trickles), f"{len(trickles) - len(closed)} connections held"
        # a connection closed for slow headers is no request: not counted
        # (docs/observability.md), only the requests served meanwhile are
        assert counted_since(s.base, before) == {"GET /livez 200": served_meanwhile}


def test_header_deadline_spares_pipelined_requests_and_cuts_a_late_one() -> None:
    def get(route: str) -> bytes:
        return f"GET {route} HTTP/1.1\r\nHost: x\r\n\r\n".encode()

    with served("--header-timeout", "1") as s:
        # three complete requests in one packet: all answered, in order, on a
        # connection that stays open (no deadline runs while they are served)
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(get("/livez") + get("/readyz") + get("/livez"))
            got = b""
            while got.count(b"HTTP/1.1 200") < 3:
                chunk = sock.recv(65536)
                assert chunk, f"closed after {got.count(b'HTTP/1.1 200')} answers"
                got += chunk
        # a complete request followed by the start of another whose headers
        # never end: the first is answered, then the connection is closed
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(get("/livez") + b"GET /livez HTTP/1.1\r\nHost: x\r\n")
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
            assert got.count(b"HTTP/1.1 200") == 1
            assert time.monotonic() - started < 5


# --------------------------------------------------------------------------- bodies


def trickle_body(port: int, token: str = TOKEN) -> socket.socket:
    """A PUT that announces 100 bytes of body and sends one."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + token.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    return sock


def test_slow_bodies_get_408_and_do_not_hold_shutdown(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    flags = ("--body-timeout", "1", "--stop-timeout", "30")
    with served(*flags, log_path=log_path) as server:
        port, proc = server.port, server.proc
        # twenty clients trickle a byte now and then: each is answered 408 and
        # closed, however long it would go on (once held until it stopped)
        socks = [trickle_body(port) for _ in range(20)]
        for sock in socks:
            sock.sendall(b'"')
        answers = []
        for sock in socks:
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    got += chunk
            answers.append(got)
            sock.close()
        for got in answers:
            assert status_of(got) == 408, got[:200]
            assert b'"request_timeout"' in got and b"connection: close" in got
        # one more, stalled at SIGTERM: shutdown does not wait for it (once
        # it waited the whole --stop-timeout, then logged a 500)
        stalled = trickle_body(port)
        time.sleep(0.2)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - stopped < 15  # far below --stop-timeout 30
        stalled.close()
    text = log_path.read_text()
    assert "Exception in ASGI application" not in text and " 500" not in text, text[-2000:]


def api_requests(base: str) -> dict[str, float]:
    """'NAME OUTCOME' -> kvoffload_api_requests_total, from /metrics."""
    text = httpx.get(f"{base}/metrics", headers=READ).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvoffload_api_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            name = labels.split('name="', 1)[1].split('"', 1)[0]
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            out[f"{name} {outcome}"] = float(value)
    return out


def test_a_client_leaving_mid_body_is_counted_closed_and_is_no_error(tmp_path: Path) -> None:
    # it was an "Exception in ASGI application" traceback, logged as an error
    # and counted a 500, that any client could cause at will
    log_path = tmp_path / "serve.log"
    with served(log_path=log_path) as server:
        for _ in range(3):
            sock = trickle_body(server.port)
            time.sleep(0.1)
            sock.close()
        # an event stream is counted as it opens, while it is still open
        stream, head = open_stream(server.port)
        assert status_of(head) == 200

        def counted() -> bool:
            seen = api_requests(server.base)
            return (
                seen.get("PUT /v1/policy closed") == 3
                and seen.get("GET /v1/events/stream 200") == 1
            )

        deadline = time.monotonic() + 10
        while not counted():
            assert time.monotonic() < deadline, api_requests(server.base)
            time.sleep(0.2)
        assert "PUT /v1/policy 500" not in api_requests(server.base)
        stream.close()
        assert httpx.get(f"{server.base}/livez").status_code == 200
    text = log_path.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-2000:]


def test_what_the_http_parser_refuses_has_the_error_shape(server: Served) -> None:
    for request in (
        b"FOO /v1/policy HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/policy:validate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Content-Length: 3\r\n\r\n{}",
        b"GET /livez HTTP/1.1\nHost: x\n\n",
    ):
        answer = raw_request(server.port, request)
        assert status_of(answer) == 400, answer[:300]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"content-type: application/json" in head.lower()
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "bad_request"


@pytest.mark.parametrize(
    ("request_", "status", "code", "says"),
    [
        # RFC 9112, 3.2 (was answered 200)
        (b"GET /livez HTTP/1.1\r\n\r\n", 400, "bad_request", "needs a Host header"),
        (
            b"GET /livez HTTP/2.0\r\nHost: x\r\n\r\n",
            505,
            "http_version_not_supported",
            "HTTP/2.0 is not served",
        ),
        (b"GET /livez HTTP/1.0\r\n\r\n", 200, None, None),  # 1.0 has no Host
        # RFC 9112, 3.2: two Hosts (was answered 200, the first one read)
        (b"GET /livez HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "bad_request", "2 Host"),
        # a second Content-Type was ignored, the body read as the first one said
        (
            b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Type: text/plain\r\nContent-Length: 16\r\n\r\n{"policy":"arc"}',
            400,
            "bad_request",
            "2 Content-Type headers",
        ),
        # RFC 9112, 6.1: a coding not served is a 501 (a gzip body was read as
        # JSON and applied)
        (
            b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: gzip, chunked\r\n\r\n10\r\n{"policy":"arc"}\r\n0\r\n\r\n',
            501,
            "not_implemented",
            "only transfer coding served is chunked",
        ),
        # RFC 9112, 6.3: chunked not last leaves the length unknown (was a 408
        # after the body timeout)
        (
            b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: gzip\r\n\r\n{}",
            400,
            "bad_request",
            "does not frame the body",
        ),
    ],
)
def test_the_http_version_host_and_framing_are_checked(
    server: Served, request_: bytes, status: int, code: str | None, says: str | None
) -> None:
    answer = raw_request(server.port, request_)
    assert status_of(answer) == status, answer[:300]
    if says is not None:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert b"content-type: application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == code
        assert says in error["message"]


def test_a_body_whose_chunks_do_not_parse_is_answered_at_once(server: Served) -> None:
    # a chunk size that is no number: the body can never be in, so the
    # parser's 400 is the answer, not a 408 after the body timeout (10 s)
    answer = raw_request(
        server.port,
        b"PUT /v1/policy HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n" % TOKEN.encode(),
    )
    assert status_of(answer) == 400, answer[:300]  # was 408
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "bad_request"
    assert httpx.get(f"{server.base}/v1/policy", headers=READ).status_code == 200


def counted_since(base: str, before: dict[str, float]) -> dict[str, float]:
    """What ``kvoffload_api_requests_total`` counted since ``before`` (the
    scrapes themselves left out)."""
    time.sleep(0.3)  # past the /metrics cache's age bound (0.1 s)
    after = api_requests(base)
    return {
        key: after.get(key, 0) - before.get(key, 0)
        for key in after.keys() | before.keys()
        if key != "GET /metrics 200" and after.get(key, 0) != before.get(key, 0)
    }


def test_what_the_http_parser_refuses_is_not_counted(server: Served) -> None:
    # docs/observability.md: no request exists, so none is counted (no 400,
    # 505 or unrouted series from them)
    before = api_requests(server.base)
    for request, status in (
        (b"FOO /v1/policy HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # a bad request line
        (b"GET /livez HTTP/1.1\nHost: x\n\n", 400),
        (b"GET /livez HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /livez HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /nowhere HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ):
        answer = raw_request(server.port, request)
        assert status_of(answer) == status, answer[:300]
    # a request that does exist is counted: the comparison sees counts
    assert status_of(raw_request(server.port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
    assert counted_since(server.base, before) == {"GET /livez 200": 1}
    assert not any(key.endswith(" 505") for key in api_requests(server.base))


def send_head(port: int, lines: Iterator[bytes]) -> bytes:
    """Send a request head line by line, as long as the server reads, and
    return its answer (the server may close before the head is all sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for line in lines:
                sock.sendall(line)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def head(*headers: bytes) -> Iterator[bytes]:
    yield b"GET /livez HTTP/1.1\r\nHost: x\r\n"
    yield from headers
    yield b"\r\n"


def test_request_headers_over_the_cap_are_a_431_and_the_connection_closes(
    server: Served,
) -> None:
    # the parser kept every byte of a head: one 62 MiB header, or 2,000,000
    # header lines, were taken (found by an audit); the cap is 64 KiB
    big = b"X-Big: " + b"a" * 16384
    answers = {
        "one 16 MiB header": send_head(
            server.port, head(b"X-Big: ", *(b"a" * 65536 for _ in range(256)), b"\r\n")
        ),
        "20,000 header lines": send_head(
            server.port, head(*(b"X-A: 1\r\n" for _ in range(20_000)))
        ),
        "five 16 KiB headers": send_head(server.port, head(*(big + b"\r\n" for _ in range(5)))),
        # in one write, its end in the same read as the cap's crossing: it was
        # served (the cap looked only at heads still incomplete after a read)
        "a 100,000-byte head in one write": raw_request(
            server.port, b"".join(head(b"X-Big: " + b"a" * 100_000 + b"\r\n"))
        ),
    }
    for what, answer in answers.items():
        assert status_of(answer) == 431, (what, answer[:300])
        head_, _, body = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head_.lower()
        # rendered as the routes render their errors: compact
        assert body.startswith(b'{"error":{"code":"headers_too_large","message":'), body[:80]
        error = json.loads(body)["error"]
        assert error["code"] == "headers_too_large"
        assert "larger than 65536 bytes" in error["message"]
    # under the cap is served, and so is everyone else
    answer = raw_request(server.port, b"".join(head(*(big + b"\r\n" for _ in range(3)))))
    assert status_of(answer) == 200, answer[:300]
    # refused before a request exists: not in the API's own metrics (as documented)
    metrics = httpx.get(f"{server.base}/metrics", headers=READ, timeout=10).text
    assert 'kvoffload_api_requests_total{name="GET /livez",outcome="200"}' in metrics
    assert 'outcome="431"' not in metrics


@pytest.mark.parametrize(
    ("refused", "status"),
    [
        (b"GET /livez HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    ],
    ids=["no-host", "too-large"],
)
def test_a_refused_request_is_answered_after_the_requests_before_it(
    server: Served, refused: bytes, status: int
) -> None:
    # HTTP/1.1 answers in order: the refusal was written at once, in place of
    # the answer to the valid request before it, which was never sent (a
    # review found it)
    stream = (
        f"GET /v1/events/stream?after_seq=0&limit=3 HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: {READ['Authorization']}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(stream + refused)
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    first, _, rest = answer.partition(b"\r\n\r\n")
    assert status_of(first) == 200, answer[:300]
    end = rest.find(b"\r\n0\r\n\r\n")  # the stream's last chunk
    assert end >= 0 and b"id: " in rest[:end], rest[:300]  # its records, then its end
    assert status_of(rest[end + len(b"\r\n0\r\n\r\n") :]) == status, rest[-400:]


def test_head_is_get_without_the_body(server: Served) -> None:
    for route in ("/livez", "/readyz", "/v1/policy", "/metrics"):
        get = httpx.get(f"{server.base}{route}", headers=READ, timeout=5)
        head = raw_request(
            server.port,
            f"HEAD {route} HTTP/1.1\r\nHost: x\r\nAuthorization: {READ['Authorization']}"
            "\r\nConnection: close\r\n\r\n".encode(),
        )
        assert status_of(head) == get.status_code == 200, (route, head[:200])
        assert head.endswith(b"\r\n\r\n"), "a HEAD answer carries no body"
        assert f"content-type: {get.headers['content-type']}".encode() in head.lower()
    # the event stream has no end, so neither would its HEAD: 405
    stream = raw_request(
        server.port,
        f"HEAD /v1/events/stream HTTP/1.1\r\nHost: x\r\nAuthorization: {READ['Authorization']}"
        "\r\nConnection: close\r\n\r\n".encode(),
    )
    assert status_of(stream) == 405


def test_a_token_in_the_query_string_is_masked_in_the_access_log(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    secret = "q5ecret-token-in-a-query"
    with served("--log-level", "debug", log_path=log_path) as server:
        base = server.base
        r = httpx.put(f"{base}/v1/policy?access_token={secret}&limit=3", json={"policy": "arc"})
        assert r.status_code == 401
        assert httpx.get(f"{base}/v1/events?limit=2&after_seq=0", headers=READ).status_code == 200
        # the service's own token as a parameter's name: masked too, never echoed
        bare = httpx.put(f"{base}/v1/policy?{TOKEN}", json={"policy": "arc"})
        assert bare.status_code == 401
        assert "the query string is not read" in bare.json()["error"]["message"]
        unknown = httpx.get(f"{base}/v1/cache?{READ_TOKEN}&limit=1", headers=READ)
        assert unknown.status_code == 422
        assert "holds this service's token" in unknown.json()["error"]["message"]
        answers = bare.text + unknown.text
    text = log_path.read_text()
    for token in (secret, TOKEN, READ_TOKEN):
        assert token not in text
        assert token not in answers
    assert "/v1/policy?***&limit=3 " in text
    assert "/v1/policy?*** " in text and "/v1/cache?***&limit=1 " in text
    assert "/v1/events?limit=2&after_seq=0 " in text  # what the API takes is shown


# --------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("token", ["s3cr3t\n", " s3cr3t", "s3cr3t ", ""])
def test_padded_or_empty_token_is_refused_at_start(token: str) -> None:
    proc = serve("--port", str(free_port()), env={"KVOFFLOAD_ADMIN_TOKEN": token})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith("kvoffload serve: error: KVOFFLOAD_ADMIN_TOKEN: ")
    assert ("empty" if not token else "whitespace") in lines[0]
    assert "s3cr3t" not in out


@pytest.mark.parametrize(
    ("flags", "code", "fragment"),
    [
        (["--device", "cuda:7"], 2, "device 'cuda:7' is not available"),
        (["--uds", "/nonexistent/dir/sock"], 2, "unrecognized arguments: --uds"),
        (["--host", "no-such-host.invalid"], 1, "cannot listen on no-such-host.invalid"),
        (
            ["--max-waiting-requests", "2", "--max-requests-per-step", "4"],
            2,
            "--max-waiting-requests / KVOFFLOAD_MAX_WAITING_REQUESTS (2) must be at least "
            "--max-requests-per-step / KVOFFLOAD_MAX_REQUESTS_PER_STEP (4)",
        ),
        # an audit's: 100000000 filled the queue before the first step, for
        # ever (gigabytes; commands and the stop waited)
        (
            ["--max-waiting-requests", "100001"],
            2,
            "--max-waiting-requests / KVOFFLOAD_MAX_WAITING_REQUESTS must be at most 100000",
        ),
        # an audit's: it named no flag (checked as the engine was built)
        (
            [
                "--workload",
                "data/traces/mooncake_synthetic_trace.jsonl",
                "--trace-block-size",
                "100",
            ],
            2,
            "the workload's --trace-block-size / KVOFFLOAD_TRACE_BLOCK_SIZE (100) and "
            "--gpu-block-size / KVOFFLOAD_GPU_BLOCK_SIZE (16) must divide one another",
        ),
    ],
)
def test_bad_start_up_settings_fail_in_one_line(flags: list[str], code: int, fragment: str) -> None:
    proc = serve(
        "--port", str(free_port()), "--device", "cpu", *flags, env={"KVOFFLOAD_ADMIN_TOKEN": TOKEN}
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, out
    assert fragment in out
    assert "Traceback" not in out


def test_an_engine_that_does_not_stop_in_time_is_exit_3(tmp_path: Path) -> None:
    # found by an audit: the status was 0, "a clean shutdown", after the
    # engine had not stopped within --stop-timeout
    (tmp_path / "stall_policy.py").write_text(
        "import time\n"
        "from kvoffload.policies import register_policy\n"
        "from kvoffload.policies.lru import LRUPolicy\n"
        "class Stall(LRUPolicy):\n"
        "    def insert(self, block_hashes, blocks):\n"
        "        time.sleep(3)\n"
        "        super().insert(block_hashes, blocks)\n"
        "register_policy('stall', 'stall_policy:Stall')\n"
    )
    port = free_port()
    proc = serve(
        "--port", str(port), "--device", "cpu", "--imports", "stall_policy", "--policy", "stall",
        "--stop-timeout", "0.5",
        env={"KVOFFLOAD_ADMIN_TOKEN": TOKEN, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        time.sleep(0.5)  # its engine is in a 3 s store by now
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, out
    assert "engine did not stop cleanly within 0.5 s" in out


def test_port_in_use_is_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve("--port", str(port), "--device", "cpu")
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    # one line, as the other start-up errors: the engine started, ran and
    # stopped first, and the error was the 3rd of 7 log lines (walkthrough)
    assert out.strip().splitlines() == [
        f"kvoffload serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
