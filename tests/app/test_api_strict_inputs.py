"""Input the API refuses instead of guessing at, each with an error that says
what is wrong (docs/api.md, Errors and Limits): bodies checked before FastAPI
parses them (app/bodies.py), strict query integers, one Authorization header,
policy names as listed, a cursor ahead of the log; and what a retried or
repeated request keeps (a switch to the policy in use changes nothing)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from api_support import ADMIN_HEADERS, ClientFactory, TestClient

from app.errors import MAX_ISSUES

JSON = {**ADMIN_HEADERS, "Content-Type": "application/json"}


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client(read_token=None)  # reads open: GETs below carry no token


def error_of(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    message: str = error["message"]
    return message


def paused(client: TestClient) -> TestClient:
    assert client.post("/v1/runtime:pause", headers=ADMIN_HEADERS).status_code == 200
    return client


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("route", ["/v1/policy:validate", "/v1/policy"])
@pytest.mark.parametrize("name", ["\\ud800", "arc\\ud800", "\\udfff\\ud800"])
def test_lone_surrogates_in_a_policy_name_are_a_422(
    client: TestClient, route: str, name: str
) -> None:
    # valid JSON escapes of no character: once a 500 (pydantic could not
    # render the message of a name it held)
    method = "PUT" if route == "/v1/policy" else "POST"
    r = client.request(method, route, content=f'{{"policy": "{name}"}}'.encode(), headers=JSON)
    assert r.status_code == 422, r.text


def test_unknown_policy_message_names_it_and_the_valid_ones(client: TestClient) -> None:
    r = client.post("/v1/policy:validate", json={"policy": "fifo"}, headers=ADMIN_HEADERS)
    message = error_of(r, 422, "unknown_policy")
    assert message.startswith("unknown eviction policy 'fifo'; valid policies: arc, ")
    assert "{" not in message  # once the unfilled template "{policy!r}"
    assert r.json()["error"]["valid_policies"] == ["arc", "hkvarc", "kvarc", "lru"]


@pytest.mark.parametrize("name", [" ARC ", "ARC", "arc\n", "Lru"])
def test_policy_names_are_not_fixed_up(client: TestClient, name: str) -> None:
    r = client.put("/v1/policy", json={"policy": name}, headers=ADMIN_HEADERS)
    message = error_of(r, 422, "unknown_policy")
    assert f"{name.strip().lower()!r}?" in message  # the hint
    assert client.get("/v1/policy").json()["version"] == 1


def test_a_long_policy_name_is_refused_before_it_is_stripped(client: TestClient) -> None:
    r = client.put("/v1/policy", json={"policy": " " * 100_000 + "arc"}, headers=ADMIN_HEADERS)
    assert "at most 64 characters" in error_of(r, 422, "invalid_request")


def test_every_problem_of_a_body_is_told(client: TestClient) -> None:
    r = client.put(
        "/v1/policy", json={"policy": "fifo", "expected_version": "x"}, headers=ADMIN_HEADERS
    )
    message = error_of(r, 422, "unknown_policy")
    assert (
        "'fifo'" in message
        and "body.expected_version: Input should be a valid integer, not a string" in message
    )
    assert len(r.json()["error"]["issues"]) == 2


def test_a_key_given_twice_is_refused_and_nothing_happens(client: TestClient) -> None:
    paused(client)
    used = client.get("/v1/cache").json()["blocks"]["used"]
    r = client.post("/v1/cache:reset", content=b'{"confirm": false, "confirm": true}', headers=JSON)
    assert "'confirm' twice" in error_of(r, 422, "invalid_request")
    assert used > 0 and client.get("/v1/cache").json()["blocks"]["used"] == used
    r = client.put("/v1/policy", content=b'{"policy": "fifo", "policy": "arc"}', headers=JSON)
    assert "'policy' twice" in error_of(r, 422, "invalid_request")
    assert client.get("/v1/policy").json()["policy"] == "lru"


@pytest.mark.parametrize("body", [b"null", b"[]", b"3", b'"x"', b"true"])
def test_a_body_that_is_not_an_object_drains_nothing(client: TestClient, body: bytes) -> None:
    paused(client)
    buffered = client.get("/v1/cache").json()["events"]["buffered"]
    r = client.post("/v1/events:drain", content=body, headers=JSON)
    assert "must be a JSON object" in error_of(r, 422, "invalid_request")
    assert buffered > 0 and client.get("/v1/cache").json()["events"]["buffered"] == buffered


@pytest.mark.parametrize("route", ["/v1/runtime:pause", "/v1/runtime:resume"])
def test_pause_and_resume_take_no_body(client: TestClient, route: str) -> None:
    assert error_of(client.post(route, content=b"garbage{", headers=JSON), 400, "malformed_json")
    message = error_of(
        client.post(route, json={"x": 1}, headers=ADMIN_HEADERS), 422, "invalid_request"
    )
    assert "takes no body" in message
    assert client.post(route, json={}, headers=ADMIN_HEADERS).status_code == 200
    assert client.post(route, headers=ADMIN_HEADERS).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "application/x-www-form-urlencoded",
        "text/plain",
        "application/json; charset=latin-1",
        "application/merge-patch+json",
    ],
)
def test_a_body_must_be_sent_as_json(client: TestClient, content_type: str | None) -> None:
    headers = dict(ADMIN_HEADERS) | ({"Content-Type": content_type} if content_type else {})
    r = client.post("/v1/policy:validate", content=b'{"policy": "arc"}', headers=headers)
    message = error_of(r, 415, "unsupported_media_type")
    assert "'Content-Type: application/json'" in message and "got" in message


@pytest.mark.parametrize("content_type", ["application/json", 'Application/JSON; charset="UTF-8"'])
def test_json_with_or_without_utf8_charset_is_taken(client: TestClient, content_type: str) -> None:
    headers = {**ADMIN_HEADERS, "Content-Type": content_type}
    r = client.post("/v1/policy:validate", content=b'{"policy": "arc"}', headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        (b'{"policy": "arc",}', 400, "malformed_json", "at line 1 column 18"),
        (b'{"policy": "arc", "expected_version": NaN}', 400, "malformed_json", "NaN is not"),
        (b"\xff{}", 400, "malformed_json", "not UTF-8 (byte 0)"),
        (b"[" * 100_000 + b"]" * 100_000, 422, "invalid_request", "deeper than the API reads"),
        (
            b'{"policy": "arc", "expected_version": 1' + b"0" * 5000 + b"}",
            422,
            "invalid_request",
            "more than 4300 digits",
        ),
    ],
)
def test_unreadable_bodies_say_why(
    client: TestClient, body: bytes, status: int, code: str, says: str
) -> None:
    # valid JSON a parser cannot read (too deep, too long a number) was once
    # "not valid JSON"
    r = client.post("/v1/policy:validate", content=body, headers=JSON)
    assert says in error_of(r, status, code)


# --------------------------------------------------------------------------- queries, headers


@pytest.mark.parametrize("value", ["1_0", "%2B1", "%201", "01", "1.0", "1e1", "-1"])
def test_query_integers_are_plain_digits(client: TestClient, value: str) -> None:
    r = client.get(f"/v1/events?limit={value}")
    assert "decimal integer, digits only" in error_of(r, 422, "invalid_request")


def test_a_query_parameter_given_twice_is_refused(client: TestClient) -> None:
    r = client.get("/v1/events?limit=1&limit=3")
    assert "'limit' is given more than once" in error_of(r, 422, "invalid_request")


def test_a_name_repeated_thousands_of_times_is_counted_once_each(client: TestClient) -> None:
    # names.count() per name made this quadratic: 10,900 copies (65 KB) held
    # the event loop for 7 s. (The answer is what a regression keeps; the
    # cost is bench-sized, so it is not timed here.)
    r = client.get("/v1/events?" + "&".join(["limit=1"] * 6_000 + ["after_seq=0"] * 3))
    assert "'after_seq' is given more than once" in error_of(r, 422, "invalid_request")


def test_a_body_with_thousands_of_problems_lists_a_bounded_number(client: TestClient) -> None:
    # every issue was listed: 60,000 unknown keys made a 5 MB answer
    body = "{" + ",".join(f'"k{i}": 1' for i in range(3000)) + ', "policy": "lru"}'
    r = client.post("/v1/policy:validate", content=body, headers=JSON)
    message = error_of(r, 422, "invalid_request")
    issues = r.json()["error"]["issues"]
    assert len(issues) == MAX_ISSUES == 20  # docs/api.md: "the first 20"
    assert all(i["type"] == "extra_forbidden" for i in issues)
    assert message.endswith("; and 2995 more"), message[-80:]
    assert len(r.content) < 10_000


def test_a_cursor_ahead_of_the_log_is_a_conflict_not_an_empty_page(client: TestClient) -> None:
    paused(client)
    last = client.get("/v1/events?limit=1").json()["last_seq"]
    r = client.get(f"/v1/events?after_seq={last + 1000}")
    message = error_of(r, 409, "cursor_ahead")
    assert r.json()["error"]["last_seq"] == last and f"or {last}" in message
    page = client.get(f"/v1/events?after_seq={last}").json()  # caught up: empty, not an error
    assert page["events"] == [] and page["next_after_seq"] == last


@pytest.mark.parametrize("value", ["abc", "-5", "+1", "9007199254740992", "9" * 5000])
def test_a_bad_last_event_id_is_one_plain_issue(client: TestClient, value: str) -> None:
    r = client.get("/v1/events/stream?limit=1", headers={"Last-Event-ID": value})
    message = error_of(r, 422, "invalid_request")
    (issue,) = r.json()["error"]["issues"]  # once one per member of a union
    assert issue["loc"] == ["header", "Last-Event-ID"]
    assert "digits" not in message or "digits only" in message  # not Python's int() limit


def test_a_last_event_id_given_twice_is_refused(client: TestClient) -> None:
    # the route saw the first one only
    headers = [("Last-Event-ID", "1"), ("Last-Event-ID", "2")]
    r = client.get("/v1/events/stream?limit=1", headers=headers)
    assert "header 'Last-Event-ID' is given more than once" in error_of(r, 422, "invalid_request")


MAX_SEQ = 2**53 - 1  # docs/api.md: cursors and versions are capped at 2^53 - 1


@pytest.mark.parametrize(
    ("method", "target", "body", "loc"),
    [
        # JSON `true` is not a number, "3" is not an integer (lax pydantic takes both)
        ("PUT", "/v1/policy", {"policy": "arc", "expected_version": True}, "expected_version"),
        ("PUT", "/v1/policy", {"policy": "arc", "expected_version": "3"}, "expected_version"),
        (
            "POST",
            "/v1/policy:validate",
            {"policy": "arc", "expected_version": "1"},
            "expected_version",
        ),
        ("POST", "/v1/events:drain", {"limit": True}, "limit"),
        ("POST", "/v1/events:drain", {"limit": "5"}, "limit"),
        # one past 2^53 - 1, in a query and in a body
        ("GET", f"/v1/events?after_seq={MAX_SEQ + 1}", None, "after_seq"),
        (
            "PUT",
            "/v1/policy",
            {"policy": "arc", "expected_version": MAX_SEQ + 1},
            "expected_version",
        ),
    ],
    ids=[
        "version true",
        'version "3"',
        'validate version "1"',
        "drain limit true",
        'drain limit "5"',
        "after_seq 2^53",
        "version 2^53",
    ],
)
def test_booleans_strings_and_numbers_past_2_53_are_not_integers(
    client: TestClient, method: str, target: str, body: dict[str, Any] | None, loc: str
) -> None:
    r = client.request(method, target, json=body, headers=ADMIN_HEADERS)
    error_of(r, 422, "invalid_request")
    assert [issue["loc"][-1] for issue in r.json()["error"]["issues"]] == [loc]
    assert client.get("/v1/policy").json()["version"] == 1  # nothing switched


@pytest.mark.parametrize(
    ("target", "number"),
    [
        ("/v1/events:drain", "0.99999999999999999"),  # was taken as 1, and drained one
        ("/v1/events:drain", "10000.0000000000001"),  # was taken as 10000
        ("/v1/events:drain", "1e-400"),  # reads as 0
        ("/v1/policy:validate", "1.00000000000000001"),
    ],
)
def test_a_fraction_that_reads_as_an_integer_is_refused(
    client: TestClient, target: str, number: str
) -> None:
    field = "limit" if target.endswith("drain") else "expected_version"
    extra = '"policy": "arc", ' if field == "expected_version" else ""
    before = client.get("/v1/cache").json()["events"]["drained"]
    r = client.post(
        target,
        content=f'{{{extra}"{field}": {number}}}',
        headers={**ADMIN_HEADERS, "Content-Type": "application/json"},
    )
    error_of(r, 422, "invalid_request")
    message = r.json()["error"]["message"]
    assert number in message and "not an integer but reads as" in message
    assert client.get("/v1/cache").json()["events"]["drained"] == before
    # what JSON Schema calls an integer is still taken
    ok = client.post(
        target,
        content=f'{{{extra}"{field}": 1.0}}',
        headers={**ADMIN_HEADERS, "Content-Type": "application/json"},
    )
    assert ok.status_code == 200, ok.text


def test_cursors_and_versions_of_2_53_minus_1_are_taken(client: TestClient) -> None:
    # the largest value is a value, answered as such: a stale version, a
    # cursor ahead of the log; not refused as out of range
    r = client.put(
        "/v1/policy", json={"policy": "arc", "expected_version": MAX_SEQ}, headers=ADMIN_HEADERS
    )
    error_of(r, 409, "version_conflict")
    assert r.json()["error"]["expected_version"] == MAX_SEQ
    error_of(client.get(f"/v1/events?after_seq={MAX_SEQ}"), 409, "cursor_ahead")


@pytest.mark.parametrize(
    ("route", "body", "loc"),
    [
        ("/v1/events:drain", {"limit": "x"}, ["body", "limit"]),
        ("/v1/events:drain", {"limits": 5}, ["body", "limits"]),
        ("/v1/cache:reset", {"confirm": "yes"}, ["body", "confirm"]),
    ],
)
def test_an_optional_body_has_plain_issues(
    client: TestClient, route: str, body: dict[str, object], loc: list[str]
) -> None:
    # were ["body", "DrainRequest", "limit"] plus a phantom ["body", "none"]
    r = client.post(route, json=body, headers=ADMIN_HEADERS)
    error_of(r, 422, "invalid_request")
    (issue,) = r.json()["error"]["issues"]
    assert issue["loc"] == loc


def test_an_empty_last_event_id_is_no_cursor(client: TestClient) -> None:
    r = client.get("/v1/events/stream?limit=1", headers={"Last-Event-ID": ""})
    assert r.status_code == 200 and "id: " in r.text
    # and the schema says so (the fuzzer of test_api_schema.py once sent a
    # blank one as invalid data, and saw it accepted)
    operation = client.get("/openapi.json").json()["paths"]["/v1/events/stream"]["get"]
    (header,) = [p for p in operation["parameters"] if p["name"] == "Last-Event-ID"]
    assert {"const": ""} in header["schema"]["anyOf"]


def test_two_authorization_headers_are_refused(client: TestClient) -> None:
    for pair in (
        [ADMIN_HEADERS, {"Authorization": "Bearer wrong"}],
        [{"Authorization": "Bearer wrong"}, ADMIN_HEADERS],
    ):
        headers = [("Authorization", h["Authorization"]) for h in pair]
        headers.append(("Content-Type", "application/json"))
        r = client.put("/v1/policy", content=b'{"policy": "arc"}', headers=headers)
        assert "one Authorization header" in error_of(r, 401, "malformed_token")
    assert client.get("/v1/policy").json()["version"] == 1


def test_a_token_in_the_query_string_is_not_read_and_the_answer_says_so(
    client: TestClient,
) -> None:
    r = client.put("/v1/policy?access_token=admin-secret-token", json={"policy": "arc"})
    assert "the query string is not read" in error_of(r, 401, "missing_token")


# --------------------------------------------------------------------------- repeats


def test_switching_to_the_policy_in_use_changes_nothing(make_client: ClientFactory) -> None:
    client = make_client(policy="arc", read_token=None)
    deadline = time.monotonic() + 30
    while sum(client.get("/v1/cache").json()["arc"][k] for k in ("b1", "t2")) == 0:
        assert time.monotonic() < deadline, "the engine must have learned state"
        time.sleep(0.05)
    before = paused(client).get("/v1/cache").json()
    events = client.get("/v1/events?limit=10000").json()["last_seq"]
    r = client.put(
        "/v1/policy", json={"policy": "arc", "expected_version": 1}, headers=ADMIN_HEADERS
    )
    assert (
        r.status_code == 200 and r.json()["version"] == 1 and r.json()["previous_policy"] == "arc"
    )
    after = client.get("/v1/cache").json()
    assert after["arc"] == before["arc"] and after["policy_version"] == 1
    assert after["counters"]["policy_switches"] == 0
    assert client.get("/v1/events?limit=10000").json()["last_seq"] == events  # no record
    # a stale version is still refused
    stale = client.put(
        "/v1/policy", json={"policy": "arc", "expected_version": 7}, headers=ADMIN_HEADERS
    )
    error_of(stale, 409, "version_conflict")


# --------------------------------------------------------------------------- large answers


def test_large_answers_are_rendered_off_the_loop_a_few_at_a_time(client: TestClient) -> None:
    from app.state import RENDER_INLINE, RENDER_THREADS

    service = client.app.state.service  # type: ignore[attr-defined]
    seen: list[tuple[str, int]] = []
    running = peak = 0
    lock = threading.Lock()
    gate = threading.Event()

    def build() -> bytes:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            seen.append((threading.current_thread().name, threading.get_ident()))
        gate.wait(0.2)
        with lock:
            running -= 1
        return b"x"

    async def both() -> tuple[bytes, list[bytes]]:
        import asyncio

        loop_thread = threading.get_ident()
        small = await service.render(build, RENDER_INLINE)
        assert seen[-1][1] == loop_thread  # a few records: inline
        seen.clear()
        big = await asyncio.gather(*(service.render(build, RENDER_INLINE + 1) for _ in range(6)))
        assert all(ident != loop_thread for _, ident in seen)
        return small, big

    small, big = client.portal.call(both)  # type: ignore[union-attr]
    assert small == b"x" and big == [b"x"] * 6
    assert peak == RENDER_THREADS
    # docs/api.md: "more than 100 records is rendered in a worker thread, two at a time"
    assert (RENDER_INLINE, RENDER_THREADS) == (100, 2)


def test_a_page_of_more_than_100_events_is_rendered_off_the_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.state import ServiceState

    rendered: list[tuple[int, bool]] = []  # (records, built on the loop's thread)
    render = ServiceState.render

    async def spy(self: ServiceState, build: Any, records: int) -> bytes:
        loop_thread = threading.get_ident()

        def watched() -> bytes:
            rendered.append((records, threading.get_ident() == loop_thread))
            body: bytes = build()
            return body

        return await render(self, watched, records)

    deadline = time.monotonic() + 30
    while client.get("/v1/events?limit=1").json()["last_seq"] <= 101:
        assert time.monotonic() < deadline, "the engine must have logged 101 records"
        time.sleep(0.05)
    monkeypatch.setattr(ServiceState, "render", spy)
    page = client.get("/v1/events?after_seq=0&limit=101")
    assert page.status_code == 200 and len(page.json()["events"]) == 101
    small = client.get("/v1/events?after_seq=0&limit=100")
    assert small.status_code == 200 and len(small.json()["events"]) == 100
    assert rendered == [(101, False), (100, True)]


@pytest.mark.parametrize(
    ("method", "target", "body", "allowed"),
    [
        ("PUT", "/v1/policy", {"policy": 1}, 'one of "arc", "hkvarc", "kvarc", "lru"'),
        ("PUT", "/v1/policy", {}, 'one of "arc", "hkvarc", "kvarc", "lru"'),
        ("PUT", "/v1/policy", {"policy": "x" * 100}, 'one of "arc", "hkvarc", "kvarc", "lru"'),
        ("POST", "/v1/cache:reset", {"confirm": 1}, "true"),
        ("POST", "/v1/events:drain", {"limit": None}, "an integer from 1 to 10000"),
        (
            "POST",
            "/v1/events:drain",
            {"limits": 3},
            "a JSON object with the fields limit, through_seq",
        ),
        (
            "GET",
            "/v1/events?after_seq=" + "9" * 5000,
            None,
            "an integer from 0 to 9007199254740991",
        ),
        ("GET", "/v1/events?limit=0", None, "an integer from 1 to 10000"),
    ],
    ids=[
        "policy 1",
        "no policy",
        "long policy",
        "confirm 1",
        "limit null",
        "unknown field",
        "huge cursor",
        "limit 0",
    ],
)
def test_a_field_refused_says_what_it_takes(
    client: TestClient, method: str, target: str, body: dict[str, Any] | None, allowed: str
) -> None:
    # the messages said what was wrong only ("Input should be a valid
    # string"); they now say what is allowed too, from the OpenAPI document
    r = client.request(method, target, json=body, headers=ADMIN_HEADERS)
    assert f"(allowed: {allowed}" in error_of(r, 422, "invalid_request")
    assert allowed in r.json()["error"]["issues"][0]["allowed"]
