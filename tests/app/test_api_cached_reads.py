"""``app.cached_reads``: plain GETs of /v1/cache and /metrics answered before
the routes, exactly as the routes answer them."""

from __future__ import annotations

from typing import Any

import pytest
from api_support import ADMIN_HEADERS, READ_HEADERS, ClientFactory, TestClient
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from app.application import build_app
from app.cached_reads import CachedReads
from app.settings import Settings
from app.state import ServiceState


class RoutesReached:
    """Innermost middleware: counts the requests that get to the routes."""

    count = 0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            RoutesReached.count += 1
        await self.app(scope, receive, send)


def app_over(settings: Settings, service: ServiceState, cached: bool) -> TestClient:
    app = build_app(settings, service)
    if not cached:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not CachedReads]
    app.user_middleware.append(Middleware(RoutesReached))
    return TestClient(app)


def answer(client: TestClient, route: str, headers: dict[str, str]) -> tuple[Any, ...]:
    """Status, headers, body and whether the routes answered. The admin API's
    own metrics move with each request: a /metrics body is compared without
    them (and its length checked here)."""
    before = RoutesReached.count
    r = client.get(route, headers=headers)
    skip = ("date", "server", "content-length") if route == "/metrics" else ("date", "server")
    kept = sorted((k, v) for k, v in r.headers.items() if k not in skip)
    body = r.content
    if route == "/metrics":
        assert int(r.headers["content-length"]) == len(body)
        body = b"".join(
            line for line in body.splitlines(keepends=True) if b"kvoffload_api_" not in line
        )
    return r.status_code, kept, body, RoutesReached.count - before


HEADERS = {
    "read token": READ_HEADERS,
    "admin token": ADMIN_HEADERS,
    "no token": {},
    "wrong token": {"Authorization": "Bearer nope"},
    "malformed": {"Authorization": "Basic abc"},
    # /metrics in OpenMetrics (the cache keeps one body per format)
    "openmetrics": {**READ_HEADERS, "Accept": "application/openmetrics-text;version=1.0.0"},
    "text asked": {**READ_HEADERS, "Accept": "text/plain;version=0.0.4"},
}


@pytest.mark.parametrize("reads_open", [False, True], ids=["read token set", "reads open"])
def test_cached_reads_answer_as_the_routes_do(make_client: ClientFactory, reads_open: bool) -> None:
    owner = make_client(read_token=None) if reads_open else make_client()
    settings: Settings = owner.app.state.settings
    service: ServiceState = owner.app.state.service
    assert owner.post("/v1/runtime:pause", headers=ADMIN_HEADERS).json()["state"] == "paused"
    fast, plain = app_over(settings, service, True), app_over(settings, service, False)
    for route in ("/v1/cache", "/metrics"):
        for name, headers in HEADERS.items():
            status, kept, body, reached = answer(fast, route, headers)
            assert (status, kept, body) == answer(plain, route, headers)[:3], (route, name)
            assert answer(plain, route, headers)[3] == 1
            # the cached reads answer what passes the read check; the routes
            # answer the rest (the 401s)
            assert reached == (status != 200), (route, name, status)
            if not reads_open and name in ("no token", "wrong token", "malformed"):
                assert status == 401
        # with a query (the route refuses it), or another method: the routes
        assert answer(fast, f"{route}?x=1", READ_HEADERS)[0] == 422
        assert fast.post(route, headers=READ_HEADERS).status_code == 405
        # HEAD is a GET without the body (app.limits), cached or not
        head = fast.head(route, headers=READ_HEADERS)
        assert head.status_code == 200 and head.content == b"", route
    assert fast.get("/v1/cache", headers=READ_HEADERS).json()["state"] == "paused"
