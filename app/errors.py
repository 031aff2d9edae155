"""One error shape for every failure: ``{"error": {"code": ..., "message": ...}}``.

``code`` is stable and meant for programs; ``message`` says what was wrong and
what is allowed. Routes raise :class:`ApiError` or let the library's errors
through; the handlers registered by :func:`install_error_handlers` turn those
(:func:`library_error`), FastAPI's validation errors, Starlette's HTTP errors
and anything unexpected into that shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.limits import NO_HEAD
from app.policy_name import UNKNOWN_POLICY
from kvoffload.errors import KVOffloadError, PolicyError, PolicyFailedError
from kvoffload.policies import available_policies
from kvoffload.runtime.commands import (
    EngineStoppedError,
    UnsupportedCommandError,
    VersionConflictError,
)

__all__ = [
    "ApiError",
    "ErrorBody",
    "ErrorInfo",
    "ValidationIssue",
    "error_responses",
    "install_error_handlers",
    "library_error",
]

logger = logging.getLogger(__name__)


class ValidationIssue(BaseModel):
    """One problem found in the request."""

    loc: list[str | int] = Field(description="where: location then field path")
    msg: str
    type: str
    allowed: str | None = Field(
        None, description="what the field takes, from this document (where it has a schema)"
    )


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str = Field(description="stable machine-readable code", examples=["unknown_policy"])
    message: str = Field(description="what was wrong and what is allowed")
    issues: list[ValidationIssue] | None = Field(
        None, description="each invalid field (validation errors only)"
    )
    valid_policies: list[str] | None = Field(None, description="on unknown_policy")
    current_version: int | None = Field(None, description="on version_conflict")
    expected_version: int | None = Field(None, description="on version_conflict")


class ErrorBody(BaseModel):
    """The body of every non-2xx answer."""

    error: ErrorInfo


class ApiError(Exception):
    """An error answer: HTTP ``status``, a stable ``code``, a ``message`` and
    optional extra fields for the ``error`` object."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers) if headers else None
        self.extra = extra


def library_error(exc: Exception) -> ApiError | None:
    """The answer to an error of the library, ``None`` for one that is a bug here."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PolicyFailedError):  # registered, but its code failed
        return ApiError(409, "policy_failed", str(exc))
    if isinstance(exc, PolicyError):
        return unknown_policy(str(exc))
    if isinstance(exc, VersionConflictError):
        return ApiError(
            409,
            "version_conflict",
            f"the policy version is {exc.current}, not the expected {exc.expected}; "
            "GET /v1/policy and retry with the current version",
            expected_version=exc.expected,
            current_version=exc.current,
        )
    if isinstance(exc, UnsupportedCommandError):
        return ApiError(409, "not_supported", str(exc))
    if isinstance(exc, EngineStoppedError):
        return ApiError(
            503,
            "engine_stopped",
            f"the engine is not running, so it cannot apply commands ({exc})",
        )
    return None


def unknown_policy(message: str) -> ApiError:
    return ApiError(422, "unknown_policy", message, valid_policies=list(available_policies()))


def error_json(
    status: int,
    code: str,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    body.update({k: v for k, v in extra.items() if v is not None})
    return JSONResponse(
        {"error": jsonable_encoder(body)}, status_code=status, headers=dict(headers or {})
    )


_DESCRIPTIONS: dict[int, str] = {
    400: "The body is not valid JSON (or not UTF-8)",
    401: "Missing, malformed or unknown bearer token",
    403: "The token lacks the scope, or the route is disabled",
    404: "No such resource",
    408: "The request body did not arrive within the body timeout",
    409: "The policy version changed since it was read, the target does not support this, "
    "or the cursor is ahead of the event log",
    413: "The request body is larger than the service accepts",
    415: "The body is not sent as Content-Type: application/json",
    422: "The request failed validation; `issues` or the message say which field and why",
    503: "The engine is not running, or too many event streams are open",
    504: "The engine did not apply the command in time",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries for the given error statuses."""
    return {
        status: {"model": ErrorBody, "description": _DESCRIPTIONS.get(status, "Error")}
        for status in statuses
    }


_STATUS_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    408: "request_timeout",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
}


#: what FastAPI raises (as a 400) for a body it cannot decode (e.g. not UTF-8)
_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"


def _issue_text(issue: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in issue.get("loc", ()))
    text = f"{loc}: {issue.get('msg', 'invalid')}" if loc else str(issue.get("msg", "invalid"))
    allowed = issue.get("allowed")
    return f"{text} (allowed: {allowed})" if allowed else text


#: issues an answer lists; its message says how many more there were
MAX_ISSUES = 20


def _issues(errors: Sequence[Any], request: Request | None = None) -> list[dict[str, Any]]:
    out = []
    for raw in errors[:MAX_ISSUES]:
        issue = raw if isinstance(raw, Mapping) else {}
        loc = [p if isinstance(p, int) else str(p) for p in issue.get("loc", ())]
        item = {
            "loc": loc,
            "msg": str(issue.get("msg", "invalid")),
            "type": str(issue.get("type", "value_error")),
        }
        allowed = _allowed(request, loc) if request is not None else None
        if allowed:
            item["allowed"] = allowed
        out.append(item)
    return out


def _allowed(request: Request, loc: list[str | int]) -> str | None:
    """What the field at ``loc`` takes, said from the app's own OpenAPI
    document (the contract the client can read), or ``None``."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not loc:
        return None
    method = "get" if request.method == "HEAD" else request.method.lower()
    document = request.app.openapi()
    operation = document.get("paths", {}).get(route.path, {}).get(method)
    if operation is None:
        return None
    where = loc[0]
    if where == "body":
        media = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
        body = _resolve(document, media.get("schema", {}))
        fields = body.get("properties", {})
        field = fields.get(str(loc[1])) if len(loc) > 1 else None
        if field is not None:
            return _describe(_resolve(document, field))
        required = set(body.get("required", ()))
        names = [f"{name} (required)" if name in required else name for name in fields]
        return f"a JSON object with the fields {', '.join(names)}" if names else None
    if where in ("query", "header") and len(loc) > 1:
        for parameter in operation.get("parameters", ()):
            if parameter.get("in") == where and parameter["name"].lower() == str(loc[1]).lower():
                return _describe(_resolve(document, parameter.get("schema", {})))
    return None


def _resolve(document: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
        resolved: Mapping[str, Any] = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
        return resolved
    return schema


def _describe(schema: Mapping[str, Any]) -> str | None:
    """A JSON Schema of the kinds the API's fields use, in words."""
    if "anyOf" in schema:
        parts = [_describe(part) for part in schema["anyOf"]]
        return " or ".join(p for p in parts if p) or None
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and high is not None:
            return f"an integer from {int(low)} to {int(high)}"
        if low is not None:
            return f"an integer of at least {int(low)}"
        return "an integer"
    if kind == "string":
        longest = schema.get("maxLength")
        return f"a string of at most {longest} characters" if longest else "a string"
    if kind == "boolean":
        return "true or false"
    if kind == "null":
        return "null"
    return None


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_json(exc.status, exc.code, exc.message, headers=exc.headers, **exc.extra)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # a body of 60,000 unknown keys was a 5 MB answer rendered on the event
    # loop (5 s): the answer lists the first MAX_ISSUES, the message counts all
    errors = exc.errors()
    issues = _issues(errors, request)
    more = len(errors) - len(issues)
    if any(i["type"] == "json_invalid" for i in issues):
        return _malformed_body(issues)
    policy = next((i for i in issues if i["type"] == UNKNOWN_POLICY), None)
    if policy is not None:
        # the policy's message first; the other fields' problems after it
        others = [i for i in issues if i is not policy]
        message = policy["msg"] + (f"; also: {_issues_text(others, more)}" if others else "")
        error = unknown_policy(message)
        return error_json(422, error.code, message, issues=issues, **error.extra)
    summary = "the request does not match the API schema"
    text = _issues_text(issues, more)
    return error_json(422, "invalid_request", f"{summary}: {text}", issues=issues)


def _issues_text(issues: list[dict[str, Any]], more: int = 0) -> str:
    """The first five issues, and how many more (``more``: those not in ``issues``)."""
    text = "; ".join(_issue_text(i) for i in issues[:5])
    rest = max(len(issues) - 5, 0) + more
    return text + (f"; and {rest} more" if rest > 0 else "")


def _malformed_body(issues: list[dict[str, Any]] | None = None) -> JSONResponse:
    return error_json(
        400,
        "malformed_json",
        "the request body is not valid JSON; send a UTF-8 JSON object "
        "with 'Content-Type: application/json'",
        issues=issues,
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 400 and exc.detail == _FASTAPI_BODY_PARSE_ERROR:
        return _malformed_body()
    code = _STATUS_CODES.get(status, "http_error" if status < 500 else "internal_error")
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else ""
    if status == 404:
        message = f"no route {request.url.path!r}; see /docs for the routes"
    elif status == 405:
        # Starlette names only the first route that matched the path; list them all.
        allowed = ", ".join(_allowed_methods(request))
        headers = {**(exc.headers or {}), "Allow": allowed}
        message = f"{request.method} is not allowed on {request.url.path!r}; allowed: {allowed}"
        return error_json(status, code, message, headers=headers)
    else:
        message = detail or phrase
    return error_json(status, code, message, headers=exc.headers)


def _allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    routes: list[APIRoute] = getattr(request.app.state, "api_routes", [])
    for route in routes:
        if route.path_regex.match(request.url.path):
            methods.update(route.methods or ())
    if "GET" in methods and request.url.path not in NO_HEAD:
        methods.add("HEAD")  # app.limits answers it
    return sorted(methods)


async def _library_error(request: Request, exc: Exception) -> JSONResponse:
    error = library_error(exc)
    if error is None:
        return await _unexpected_error(request, exc)
    return await _api_error(request, error)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_json(
        500,
        "internal_error",
        "the service failed to handle this request; the error is in its log",
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(KVOffloadError, _library_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
