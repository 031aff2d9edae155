"""The two reads watchers repeat, answered before FastAPI's routing.

Dashboards poll ``GET /v1/cache`` and Prometheus scrapes ``GET /metrics``;
both bodies come from caches (:meth:`~app.state.ServiceState.cache_json`,
:meth:`~app.state.ServiceState.metrics_text`). What is left of such a request
is FastAPI's routing and dependency solving, about two thirds of its GIL
time, and the GIL is the engine thread's (``bench/api.py`` prints the time
per request). :class:`CachedReads` answers a plain ``GET`` of either path
itself once the request passes the read check, with the same status,
headers and body as the route (``tests/app/test_api_cached_reads.py``
compares them). Everything else goes on to the routes: another method, a
query string (the route says which parameters it takes), a request the read
check refuses (the route answers the 401 as always), a service not started.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.auth import check_read
from app.errors import ApiError
from app.state import METRICS_FORMATS, ServiceState, metrics_format

__all__ = ["CACHE_MEDIA_TYPE", "CachedReads"]

CACHE_MEDIA_TYPE = "application/json"


def _cache(service: ServiceState, request: Request) -> tuple[bytes, str]:
    return service.cache_json(), CACHE_MEDIA_TYPE


def _metrics(service: ServiceState, request: Request) -> tuple[bytes, str]:
    fmt = metrics_format(request.headers.get("accept"))  # as the route chooses
    return service.metrics_text(fmt), METRICS_FORMATS[fmt][0]


#: path -> the body of the current view and its content type
_READS: dict[str, Callable[[ServiceState, Request], tuple[bytes, str]]] = {
    "/v1/cache": _cache,
    "/metrics": _metrics,
}


class CachedReads:
    """ASGI middleware: plain ``GET /v1/cache`` and ``GET /metrics``
    answered from the caches (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        read = _READS.get(scope["path"]) if scope["type"] == "http" else None
        if read is None or scope["method"] != "GET" or scope["query_string"]:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        service: ServiceState | None = getattr(request.app.state, "service", None)
        try:
            check_read(request)
        except ApiError:
            service = None  # the route answers it
        if service is None:
            await self.app(scope, receive, send)
            return
        body, media_type = read(service, request)
        headers = [
            (b"content-length", str(len(body)).encode()),
            (b"content-type", media_type.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
