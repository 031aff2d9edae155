"""The front process of ``kvoffload serve``: HTTP on the public address, the
engine's process behind it on a Unix socket.

Pollers hit ``GET /v1/cache`` and ``GET /metrics`` hundreds of times a second.
Served in the engine's process, every request takes HTTP parsing and asyncio
time from the engine thread's share of the GIL: at 200 requests/s the engine
lost 12-20% of its throughput. Here a separate process answers those two
routes from a copy at most :data:`CACHE_TTL_S` old (each answer is still one
snapshot, rendered by the engine's process), and forwards everything else
as it is, streams included. Any request that is not a GET empties the copy,
so a client reads its own writes.

Auth is enforced where it always was, in the engine's process; the front only
checks a token (:func:`app.auth.reads_allowed`) before answering from its copy,
and forwards anything it cannot vouch for so the real answer (401...) comes back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from app.auth import reads_allowed
from app.settings import Settings

__all__ = ["CACHE_TTL_S", "FrontProxy"]

logger = logging.getLogger(__name__)

#: how old a cached GET /v1/cache or /metrics answer may be
CACHE_TTL_S = 0.05
_CACHED_PATHS = frozenset({"/v1/cache", "/metrics"})
#: headers that describe one hop, not the message (RFC 9110 section 7.6.1)
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class FrontProxy:
    """ASGI app forwarding to the engine's process listening on ``uds``."""

    def __init__(self, uds: str, settings: Settings) -> None:
        self.uds = uds
        self.settings = settings
        self._client: httpx.AsyncClient | None = None
        self._cache: dict[str, tuple[float, int, list[tuple[bytes, bytes]], bytes]] = {}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._client = httpx.AsyncClient(
                    transport=httpx.AsyncHTTPTransport(uds=self.uds),
                    base_url="http://kvoffload",
                    timeout=httpx.Timeout(None, connect=5.0),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        cacheable = method == "GET" and path in _CACHED_PATHS and not scope["query_string"]
        if cacheable:
            auth = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
            cacheable = reads_allowed(auth, self.settings)
            hit = self._cache.get(path)
            if cacheable and hit is not None and time.monotonic() - hit[0] < CACHE_TTL_S:
                await _answer(send, hit[1], hit[2], hit[3])
                return
        elif method != "GET":
            self._cache.clear()
        await self._forward(scope, receive, send, cache_as=path if cacheable else None)

    async def _forward(
        self, scope: dict[str, Any], receive: Receive, send: Send, cache_as: str | None
    ) -> None:
        assert self._client is not None
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        target = scope["path"] + (
            "?" + scope["query_string"].decode() if scope["query_string"] else ""
        )
        request = self._client.build_request(
            scope["method"],
            target,
            headers=[(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP],
            content=bytes(body),
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            await _answer(
                send,
                503,
                [(b"content-type", b"application/json")],
                json.dumps(
                    {
                        "error": {
                            "code": "engine_unavailable",
                            "message": f"the engine process is not answering ({exc}); "
                            "it may be starting or stopping: retry shortly",
                        }
                    }
                ).encode(),
            )
            return
        out_headers = [
            (k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP
        ]
        try:
            if cache_as is not None:
                content = await response.aread()
                if response.status_code == 200:
                    self._cache[cache_as] = (
                        time.monotonic(),
                        response.status_code,
                        out_headers,
                        content,
                    )
                await _answer(send, response.status_code, out_headers, content)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers,
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (httpx.TransportError, OSError):
            # the engine's process went away mid-stream, or the client did
            logger.debug("forwarded response to %s ended early", scope["path"])
        finally:
            await response.aclose()


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
