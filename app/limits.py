"""Limits a public service needs, below the routes: request paths routed as
written, a cap on request bodies and a deadline for a request's line and
headers.

- :class:`RequestLimits` (ASGI middleware): a path that decodes to control
  characters (``%00``, ``%0a``) names no route: 404 (Starlette's route
  patterns end in ``$``, which matches before a final newline, so
  ``/v1/cache%0a`` would reach ``/v1/cache``). A ``Content-Length`` above the cap is
  answered 413 before anything is read; a chunked body is counted as it is
  read and refused (413) once it passes the cap. An answer sent before the
  body was read to its end (a 401, a 404, a 413) closes the connection, so
  the server does not go on receiving a body nobody wants.
- :func:`header_timeout_protocol`: uvicorn's httptools protocol, closing a
  connection whose request line and headers have not all arrived within the
  deadline (a client trickling one header line at a time holds nothing for
  long). The clock starts when the connection opens, and again when an
  answer is complete and the connection waits for its next request.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["RequestLimits", "header_timeout_protocol"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes, the most this service accepts"


class RequestLimits:
    """404 for paths with control characters; 413 ``payload_too_large`` for
    request bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _CONTROL.search(scope["path"]):
            path = json.dumps(scope["path"])
            await _answer(send, 404, "not_found", f"no route {path}; see /docs for the routes")
            return
        length: int | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = int(value)  # the HTTP server checked it is a number
            elif name == b"transfer-encoding":
                chunked = True
        if length is not None and length > self.max_bytes:
            await _answer(send, 413, "payload_too_large", _too_large(self.max_bytes))
            return
        limit = self.max_bytes
        unread = chunked or bool(length)
        received = 0

        async def counted_receive() -> Message:
            nonlocal received, unread
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, _too_large(limit))
                if not message.get("more_body", False):
                    unread = False
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and unread:
                message = {**message, "headers": [*message["headers"], (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted_receive, closing_send)


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    """An error answer before the app has seen the request; the connection
    closes after it (the body, if any, stays unread)."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout: float) -> type[asyncio.Protocol]:
    """An httptools protocol class for ``uvicorn.Config(http=...)`` that closes
    a connection whose request line and headers take longer than ``timeout``."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_deadline is None:
                self._arm()  # a new request, pipelined behind the last one

        def on_headers_complete(self) -> None:
            self._disarm()  # its headers are in
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Waiting for a request again, unless a pipelined one (headers in)
            # was started; one still arriving keeps the deadline it has.
            if self._idle() and self._header_deadline is None and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            self._header_deadline = None
            # never while an answer is being made (a request pipelined behind
            # it gets a new deadline when that answer is complete)
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

    return HeaderTimeoutProtocol
