"""The admin API's own metrics: requests by route and status, and how long
each took to be answered (``kvoffload_api_requests_total``,
``kvoffload_api_request_duration_seconds``; the catalogue has their help).

:class:`RequestMetrics` is the outermost middleware, so that it sees every
answer, those of the limits (413, 408, a path with control characters) and
of the cached reads included. A request is named by its method and the
route path it matched (``PUT /v1/policy``); a path or method no route
serves is ``unrouted``, so that a scanner cannot grow the label set. It
is counted, and its duration taken, when its answer's status line is sent:
an event stream is counted as it opens, and its duration is the time to
open it, not how long it stayed open.

The counts live on the service's registry
(:class:`~kvoffload.instrumentation.prometheus.ApiMetrics`, one per
:class:`~app.state.ServiceState`), so a host's registry and the OTLP bridge
carry them like every other metric.
"""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.limits import NO_HEAD

__all__ = ["CLOSED", "UNROUTED", "RequestMetrics", "route_names"]

#: the name of a request no route serves (unknown path, or a method the path lacks)
UNROUTED = "unrouted"
#: the outcome of a request whose client left before any answer
CLOSED = "closed"


def route_names(app: Starlette) -> dict[tuple[str, str], str]:
    """``(method, path) -> "METHOD path"`` for every route ``app`` serves:
    its API routes (``app.state.api_routes``, as :func:`~app.application.build_app`
    records them) and its own (the docs); HEAD too where the app answers HEAD
    as GET (``app.limits``)."""
    names: dict[tuple[str, str], str] = {}
    for route in [*app.routes, *app.state.api_routes]:
        path = getattr(route, "path", None)
        methods = getattr(route, "methods", None)
        if not isinstance(path, str) or not methods:
            continue  # an included router: its routes are the API routes
        served = set(methods)
        if "GET" in served and path not in NO_HEAD:
            served.add("HEAD")
        for method in served:
            names[method, path] = f"{method} {path}"
    return names


class RequestMetrics:
    """ASGI middleware recording each HTTP request on the service's
    :class:`~kvoffload.instrumentation.prometheus.ApiMetrics` (see the module
    doc). Before the service is up (an app starting its own engine) nothing
    is recorded."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._names: dict[tuple[str, str], str] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        service = scope["app"].state.service if scope["type"] == "http" else None
        if service is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        metrics, name = service.api_metrics, self._name(scope)
        answered = False

        async def timed_send(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start" and not answered:
                # counted as answered here: a stream is counted as it opens
                answered = True
                metrics.record(name, str(message["status"]), time.perf_counter() - start)
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, timed_send)
        except Exception:
            failed = True  # Starlette's outermost handler answers 500
            raise
        finally:
            if not answered:
                metrics.record(name, "500" if failed else CLOSED, time.perf_counter() - start)

    def _name(self, scope: Scope) -> str:
        if self._names is None:
            self._names = route_names(scope["app"])
        return self._names.get((scope["method"], scope["path"]), UNROUTED)
