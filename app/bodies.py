"""Request bodies, checked before FastAPI parses them.

FastAPI takes a body of any ``application/*json`` type (and ignores a
declared charset), lets the last of two equal keys win, reads ``null`` as "no
body", and answers a body it cannot parse for any reason "not valid JSON".
:func:`check_body` (run by :class:`~app.auth.GuardedRoute` on every route
that is not a GET) holds bodies to what the API documents instead:

- a route that takes no body (pause, resume) accepts none, or ``{}``;
- a body is sent as ``Content-Type: application/json`` (charset, if any,
  ``utf-8``), else 415 ``unsupported_media_type``;
- it is one JSON object in UTF-8, strict JSON (no ``NaN``), else 400
  ``malformed_json`` saying where it went wrong;
- with each key once, nested no deeper, with numbers no longer than
  Python's parser reads and none that is not an integer but reads as one
  (``1.00000000000000001``), else 422 ``invalid_request`` saying which.

FastAPI then parses the body again (its ``json.loads``), with the same
result: the checks only refuse.
"""

from __future__ import annotations

import json
import sys
from decimal import Decimal
from typing import Any

from fastapi import Request

from app.errors import ApiError

__all__ = ["check_body"]

_JSON = "application/json"


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ApiError(
                422,
                "invalid_request",
                f"the body has the key {key!r} twice; send each field once",
            )
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ApiError(
        400, "malformed_json", f"the request body is not valid JSON: {name} is not a JSON number"
    )


def _number(text: str) -> float:
    """A JSON number with a fraction or an exponent, as ``json.loads`` reads it;
    refused when it is not an integer but reads as one (``0.99999999999999999``
    is 1.0 at double precision: an integer field would take it as 1)."""
    value = float(text)
    if value.is_integer():
        exact = Decimal(text)
        if exact != exact.to_integral_value():
            shown = text if len(text) <= 40 else f"{text[:40]}..."
            raise ApiError(
                422,
                "invalid_request",
                f"the body has the number {shown}, which is not an integer but reads as "
                f"{int(value)} at double precision; send integers as digits",
            )
    return value


def _check_media_type(request: Request) -> None:
    header = request.headers.get("content-type")
    media, *params = (part.strip() for part in (header or "").split(";"))
    charset_ok = all(
        p.partition("=")[0].strip().lower() == "charset"
        and p.partition("=")[2].strip().strip('"').lower() in ("utf-8", "utf8")
        for p in params
        if p
    )
    if media.lower() != _JSON or not charset_ok:
        got = f"got {header!r}" if header is not None else "got no Content-Type"
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send the body as JSON with 'Content-Type: application/json' ({got})",
        )


async def check_body(request: Request, takes_body: bool) -> None:
    """Refuse a body the route's contract does not allow (see the module doc)."""
    raw = await request.body()
    if not raw:
        return
    _check_media_type(request)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400,
            "malformed_json",
            f"the request body is not UTF-8 (byte {exc.start}); send a UTF-8 JSON object",
        ) from None
    try:
        value = json.loads(
            text, object_pairs_hook=_unique, parse_constant=_no_constant, parse_float=_number
        )
    except json.JSONDecodeError as exc:
        raise ApiError(
            400,
            "malformed_json",
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
            f"{exc.colno}; send a JSON object with 'Content-Type: application/json'",
        ) from None
    except RecursionError:
        raise ApiError(
            422,
            "invalid_request",
            "the body nests arrays or objects deeper than the API reads; its bodies are "
            "flat objects",
        ) from None
    except ValueError:  # an integer longer than int() reads
        raise ApiError(
            422,
            "invalid_request",
            f"the body has a number of more than {sys.get_int_max_str_digits()} digits; "
            "no field takes one",
        ) from None
    if not takes_body:
        if value != {}:
            raise ApiError(
                422,
                "invalid_request",
                f"{request.method} {request.url.path} takes no body; send none (or {{}})",
            )
        return
    if not isinstance(value, dict):
        raise ApiError(
            422,
            "invalid_request",
            f"the body must be a JSON object, not {_json_kind(value)}; "
            "see /docs for this route's fields",
        )


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"
