"""Bearer tokens, scopes and the loopback rule."""

from __future__ import annotations

import logging

import pytest
from api_support import ADMIN, ADMIN_HEADERS, READ, READ_HEADERS, ClientFactory, TestClient
from pydantic import ValidationError

from app.settings import Settings, is_loopback

READ_ROUTES = [
    ("GET", "/v1/cache", None),
    ("GET", "/v1/policy", None),
    ("GET", "/v1/events", None),
    ("GET", "/v1/events/stream?limit=1", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/policy:validate", {"policy": "lru"}),
]
ADMIN_ROUTES = [
    ("PUT", "/v1/policy", {"policy": "lru"}),
    ("POST", "/v1/events:drain", {"limit": 1}),
    ("POST", "/v1/runtime:pause", None),
    ("POST", "/v1/runtime:resume", None),
    ("POST", "/v1/cache:reset", {"confirm": True}),
]


def call(client: TestClient, method: str, path: str, body: object, headers: dict[str, str]) -> int:
    return client.request(method, path, json=body, headers=headers).status_code


def test_read_routes_accept_read_and_admin_tokens(client: TestClient) -> None:
    for method, path, body in READ_ROUTES:
        assert call(client, method, path, body, READ_HEADERS) == 200, path
        assert call(client, method, path, body, ADMIN_HEADERS) == 200, path


def test_admin_routes_accept_admin_token_only(client: TestClient) -> None:
    for method, path, body in ADMIN_ROUTES:
        r = client.request(method, path, json=body, headers=READ_HEADERS)
        assert r.status_code == 403, path
        assert r.json()["error"]["code"] == "insufficient_scope"
        assert call(client, method, path, body, ADMIN_HEADERS) == 200, path


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_token"),
        ({"Authorization": "Bearer"}, "malformed_token"),
        ({"Authorization": "Bearer "}, "malformed_token"),
        ({"Authorization": f"Basic {READ}"}, "malformed_token"),
        ({"Authorization": f"Bearer {READ} extra"}, "malformed_token"),
        ({"Authorization": READ}, "malformed_token"),
        ({"Authorization": "Bearer wrong-token"}, "invalid_token"),
        ({"Authorization": f"Bearer {READ}x"}, "invalid_token"),
    ],
)
def test_bad_credentials_are_401_with_challenge(
    client: TestClient, headers: dict[str, str], code: str
) -> None:
    for method, path, body in READ_ROUTES + ADMIN_ROUTES:
        r = client.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == code
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_bearer_scheme_is_case_insensitive(client: TestClient) -> None:
    assert client.get("/v1/cache", headers={"Authorization": f"bearer {READ}"}).status_code == 200


def test_probes_are_open(client: TestClient) -> None:
    assert client.get("/livez").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/openapi.json").status_code == 200


def test_reads_are_open_without_read_token(make_client: ClientFactory) -> None:
    client = make_client(read_token=None)
    for method, path, body in READ_ROUTES:
        assert call(client, method, path, body, {}) == 200, path
    # the schema says so too
    schema = client.get("/openapi.json").json()
    assert "security" not in schema["paths"]["/v1/cache"]["get"]
    assert "security" in schema["paths"]["/v1/policy"]["put"]
    # admin routes still need the admin token
    assert call(client, "PUT", "/v1/policy", {"policy": "lru"}, {}) == 401


def test_admin_routes_disabled_without_admin_token(make_client: ClientFactory) -> None:
    client = make_client(admin_token=None, read_token=None)
    for method, path, body in ADMIN_ROUTES:
        for headers in ({}, ADMIN_HEADERS, READ_HEADERS):
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 403, path
            error = r.json()["error"]
            assert error["code"] == "admin_disabled"
            assert "KVOFFLOAD_ADMIN_TOKEN" in error["message"]
    assert client.get("/v1/cache").status_code == 200


def test_startup_log_says_loopback_only_without_admin_token(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="app.application"):
        make_client(admin_token=None, read_token=None)
    text = caplog.text
    assert "no admin token" in text
    assert "loopback only" in text
    assert ADMIN not in text and READ not in text


def test_tokens_never_appear_in_logs_or_repr(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        client = make_client()
        client.put("/v1/policy", headers=ADMIN_HEADERS, json={"policy": "arc"})
        client.get("/v1/cache", headers={"Authorization": "Bearer wrong"})
    assert ADMIN not in caplog.text
    assert READ not in caplog.text
    settings = client.app.state.settings  # type: ignore[attr-defined]
    assert ADMIN not in repr(settings) and ADMIN not in str(settings.model_dump())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_non_loopback_host_needs_admin_token(host: str) -> None:
    with pytest.raises(ValidationError, match="without an admin token"):
        Settings(host=host)
    assert Settings(host=host, admin_token=ADMIN).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_token(host: str) -> None:
    assert is_loopback(host)
    assert Settings(host=host).admin_token is None


@pytest.mark.parametrize("variable", ["KVOFFLOAD_ADMIN_TOKEN", "KVOFFLOAD_READ_TOKEN"])
@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("", "empty"),
        ("s3cret\n", "whitespace"),
        (" s3cret", "whitespace"),
        ("s3cret ", "whitespace"),
    ],
)
def test_blank_or_padded_token_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, token: str, problem: str
) -> None:
    # Accepted, a padded token would never match what clients send.
    monkeypatch.setenv(variable, token)
    with pytest.raises(ValidationError, match=problem) as info:
        Settings()
    assert "s3cret" not in str(info.value)
