"""Limits a public service needs, below the routes: request paths routed as
written, a cap on request bodies and deadlines for a request's line and
headers, and for its body (and HEAD, answered as GET without a body).

- :class:`RequestLimits` (ASGI middleware): a path that decodes to control
  characters (``%00``, ``%0a``) names no route: 404 (Starlette's route
  patterns end in ``$``, which matches before a final newline, so
  ``/v1/cache%0a`` would reach ``/v1/cache``). A ``Content-Length`` above the cap is
  answered 413 before anything is read; a chunked body is counted as it is
  read and refused (413) once it passes the cap. A body not in within
  ``body_timeout`` seconds of the headers is answered 408 (a client
  trickling a byte at a time holds a connection, and shutdown, no longer
  than that). An answer sent before the body was read to its end (a 401, a
  404, a 408, a 413) closes the connection, so the server does not go on
  receiving a body nobody wants. A client that leaves before its body is
  in gets no answer and causes no error (the metrics count it ``closed``).
- :func:`header_timeout_protocol`: uvicorn's httptools protocol, closing a
  connection whose request line and headers have not all arrived within the
  deadline (a client trickling one header line at a time holds nothing for
  long). The clock starts when the connection opens, and again when an
  answer is complete and the connection waits for its next request. A
  request line and headers larger than ``max_bytes`` (the target, and each
  header's name and value plus 4 bytes, however the reads split them) are
  answered 431 and the connection closes; one still arriving is refused
  once the bytes read pass the cap, so the parser never holds much more
  (it kept them all: one 62 MiB header, or 2,000,000 header lines, were
  taken). What its parser refuses as HTTP is answered 400 in the API's
  error shape. A refusal of a request pipelined behind others goes out
  after their answers (HTTP/1.1 answers in order).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["NO_HEAD", "RequestLimits", "header_timeout_protocol"]

logger = logging.getLogger(__name__)

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: GET routes without HEAD: an event stream does not end, so neither would
#: its HEAD
NO_HEAD = frozenset({"/v1/events/stream"})


def _error_body(code: str, message: str) -> bytes:
    """The API's error shape, rendered as the routes render it (compact)."""
    return json.dumps({"error": {"code": code, "message": message}}, separators=(",", ":")).encode()


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes, the most this service accepts"


class RequestLimits:
    """404 for paths with control characters; 413 ``payload_too_large`` for
    request bodies over ``max_bytes``; 408 ``request_timeout`` for a body
    still arriving ``body_timeout`` seconds after the headers."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD" and scope["path"] not in NO_HEAD:
            # HEAD is GET without the body (RFC 9110, 9.3.2): the routes see a
            # GET, and the HTTP server, whose scope still says HEAD, sends no body
            scope = {**scope, "method": "GET"}
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
        limit, timeout = self.max_bytes, self.body_timeout
        unread = chunked or bool(length)
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def counted_receive() -> Message:
            nonlocal received, unread
            if not unread:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise HTTPException(
                    408, f"the request body did not arrive within {timeout:g} s; send it at once"
                ) from None
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

        try:
            await self.app(scope, counted_receive, closing_send)
        except ClientDisconnect:
            # the client left before its body was in: nobody to answer, and
            # nothing wrong with the server (it was an ASGI traceback, logged
            # as an error, that any client could cause at will)
            logger.debug("client left before its request body was in: %s", scope["path"])


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    """An error answer before the app has seen the request; the connection
    closes after it (the body, if any, stays unread)."""
    body = _error_body(code, message)
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


def _too_large_head(max_bytes: int) -> tuple[bytes, str, str]:
    return (
        b"431 Request Header Fields Too Large",
        "headers_too_large",
        f"the request line and headers are larger than {max_bytes} bytes, "
        "the most this service accepts; the connection closes",
    )


def _framing_refusal(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, str, str] | None:
    """What to answer a request whose headers make its meaning ambiguous
    (RFC 9112: two Hosts, 3.2; a transfer coding other than one final
    ``chunked``, 6.1 and 6.3), or ``None``. Two Content-Types would be
    resolved to the first one by the routes, so they are refused too (two
    Content-Lengths the parser refuses itself)."""
    seen: dict[bytes, int] = {}
    codings: list[bytes] = []
    for name, value in headers:
        if name in (b"host", b"content-type"):
            seen[name] = seen.get(name, 0) + 1
        elif name == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",") if c.strip()]
    for name, count in seen.items():
        if count > 1:
            return (
                b"400 Bad Request",
                "bad_request",
                f"the request has {count} {name.decode().title()} headers; send one "
                "(the connection closes)",
            )
    if not codings or codings == [b"chunked"]:
        return None
    shown = ", ".join(c.decode("latin-1") for c in codings)
    if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
        return (
            b"400 Bad Request",
            "bad_request",
            f"'Transfer-Encoding: {shown}' does not frame the body (chunked must come once, "
            "last); send Content-Length or 'Transfer-Encoding: chunked' (the connection closes)",
        )
    return (
        b"501 Not Implemented",
        "not_implemented",
        f"'Transfer-Encoding: {shown}': the only transfer coding served is chunked; send "
        "the body as it is, with Content-Length or 'Transfer-Encoding: chunked' (the "
        "connection closes)",
    )


def header_timeout_protocol(timeout: float, max_bytes: int) -> type[asyncio.Protocol]:
    """An httptools protocol class for ``uvicorn.Config(http=...)`` that closes
    a connection whose request line and headers take longer than ``timeout``
    seconds, and answers 431 to those of more than ``max_bytes``."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None
        #: bytes received since the deadline was armed (a request's line
        #: and headers, and what came in the same reads)
        _head_bytes = 0
        #: the request's target and header fields, as parsed
        _fields = 0
        #: what to answer instead of the parser's 400: (status, code, message)
        _refusal: tuple[bytes, str, str] | None = None
        #: a refusal waiting for the answers before it (HTTP/1.1 answers in order)
        _deferred: bytes | None = None

        def data_received(self, data: bytes) -> None:
            if self._deferred is not None:
                return  # the connection closes once the answers before it are out
            if self._header_deadline is not None:
                self._head_bytes += len(data)
            super().data_received(data)
            # still waiting for the end of the headers: the bytes read so far
            # bound what the parser holds (a head that ends in this read is
            # measured by its fields, in on_headers_complete)
            if (
                self._header_deadline is not None
                and self._head_bytes > max_bytes
                and not self.transport.is_closing()
            ):
                self._disarm()
                self._refuse(*_too_large_head(max_bytes))

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._fields = 0
            if self._header_deadline is None:
                self._arm()  # a new request, pipelined behind the last one

        def on_url(self, url: bytes) -> None:
            self._fields += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._fields += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()  # its headers are in
            version = self.parser.get_http_version()
            if self._fields > max_bytes:  # however the reads split it
                self._refusal = _too_large_head(max_bytes)
            elif version not in ("1.0", "1.1"):
                self._refusal = (
                    b"505 HTTP Version Not Supported",
                    "http_version_not_supported",
                    f"HTTP/{version} is not served here; send HTTP/1.1",
                )
            elif version == "1.1" and not any(name == b"host" for name, _ in self.headers):
                # RFC 9112, 3.2: an HTTP/1.1 request without Host is a 400
                self._refusal = (
                    b"400 Bad Request",
                    "bad_request",
                    "an HTTP/1.1 request needs a Host header; the connection closes",
                )
            else:
                self._refusal = _framing_refusal(self.headers)
            if self._refusal is not None:
                # the parser stops and calls send_400_response, which sends it
                raise ValueError(self._refusal[2])
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._deferred is not None:
                if self._answered():  # the last answer before the refusal
                    self._close_with(self._deferred)
                return
            # Waiting for a request again, unless a pipelined one (headers in)
            # was started; one still arriving keeps the deadline it has.
            if self._idle() and self._header_deadline is None and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_bytes = 0
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

        def _answered(self) -> bool:
            """Every request before this point has its answer out."""
            return self._idle() and not self.pipeline

        def send_400_response(self, msg: str) -> None:
            # what the HTTP parser refuses (a bad request line, two
            # Content-Lengths, bare LF line ends) gets the API's error shape
            # too, not uvicorn's text/plain
            self._refuse(
                *self._refusal
                or (
                    b"400 Bad Request",
                    "bad_request",
                    "the request is not valid HTTP/1.1 (request line, headers or framing); "
                    "the connection closes",
                )
            )

        def _refuse(self, status: bytes, code: str, message: str) -> None:
            """Answer in the API's error shape, before any route, and close;
            after the answers of the requests before it, when some are still
            being made (one sent now would be read as theirs)."""
            if self._deferred is not None or self.transport.is_closing():
                return
            body = _error_body(code, message)
            answer = (
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)
            )
            cycle = self.cycle
            if self._answered():
                self._close_with(answer)
            elif cycle is not None and cycle.more_body and not cycle.response_started:
                # the request being served has a body that breaks the framing
                # (a chunk size that is no number): it will never be in, so
                # this is its answer, now, not a 408 once the app gives up
                # waiting; the app sees its client gone and answers nothing
                cycle.disconnected = True
                cycle.message_event.set()
                self._close_with(answer)
            else:
                self._deferred = answer

        def _close_with(self, answer: bytes) -> None:
            self.transport.write(answer)
            self.transport.close()

    return HeaderTimeoutProtocol
