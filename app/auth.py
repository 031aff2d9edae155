"""Bearer-token auth with two scopes.

- **read** (GET routes): the read token or the admin token; open to everyone
  when no read token is configured.
- **admin** (everything that changes state): the admin token only; with no
  admin token configured these routes are disabled (403).

Tokens are compared in constant time and never logged. 401 (with
``WWW-Authenticate: Bearer``) means "who are you?": no, malformed or unknown
token. 403 means "I know you, but no": the read token on an admin route, or
admin routes disabled.

The decision is made from the headers alone, before the body is read or
parsed: :class:`GuardedRoute` runs the check of the scope a route declares
(``ReadAccess`` / ``AdminAccess``, i.e. :func:`require_read` /
:func:`require_admin`) ahead of FastAPI's handler, which reads the body first.
"""

from __future__ import annotations

import hmac
import re
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic import SecretStr

from app.bodies import check_body
from app.errors import ApiError
from app.settings import ENV_PREFIX, Settings

__all__ = ["GuardedRoute", "bearer_scheme", "check_query", "require_admin", "require_read", "uses"]

#: request scope key: the scope was checked before the body was read
_CHECKED = "kvoffload.auth_checked"

#: declares the scheme in OpenAPI (the "Authorize" button of /docs); the
#: checks below read the header themselves to tell missing from malformed.
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="`Authorization: Bearer <token>`: the read token for GET routes, "
    "the admin token for everything (it is valid for reads too)",
)

_REALM = 'Bearer realm="kvoffload"'

#: query parameter names a client may have put a token in
_TOKENISH = re.compile(r"token|key|auth|secret|password", re.IGNORECASE)


def _unauthorized(code: str, message: str, error: str | None = None) -> ApiError:
    challenge = f'{_REALM}, error="{error}"' if error else _REALM
    return ApiError(401, code, message, headers={"WWW-Authenticate": challenge})


def _query_holds_token(request: Request) -> bool:
    """Whether a query parameter's name or value is one of the service's
    tokens (compared in constant time): such a query is never echoed."""
    settings = _settings(request)
    tokens = [t for t in (settings.admin_token, settings.read_token) if t is not None]
    return any(
        _matches(part, token)
        for item in request.query_params.multi_items()
        for part in item
        for token in tokens
    )


def _presented_token(request: Request) -> str:
    """The bearer token of the request; 401 when absent or malformed."""
    headers = request.headers.getlist("authorization")
    if not headers:
        in_query = (
            " (in the header: the query string is not read)"
            if any(_TOKENISH.search(name) for name in request.query_params)
            or _query_holds_token(request)
            else ""
        )
        raise _unauthorized(
            "missing_token",
            f"this route needs a bearer token: send 'Authorization: Bearer <token>'{in_query}",
        )
    if len(headers) > 1:
        raise _unauthorized(
            "malformed_token",
            "send one Authorization header: this request has several",
            "invalid_request",
        )
    header = headers[0]
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        raise _unauthorized(
            "malformed_token",
            "the Authorization header must be 'Bearer <token>' with a single token",
            "invalid_request",
        )
    return token


def _matches(presented: str, expected: SecretStr | None) -> bool:
    if expected is None:
        return False
    return hmac.compare_digest(
        presented.encode("utf-8", "surrogatepass"),
        expected.get_secret_value().encode("utf-8", "surrogatepass"),
    )


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def check_read(request: Request) -> None:
    """Allow the read token or the admin token (or anyone, if reads are open)."""
    settings = _settings(request)
    if settings.read_token is None:
        return
    token = _presented_token(request)
    # Both comparisons always run so timing does not tell which token matched.
    is_read = _matches(token, settings.read_token)
    is_admin = _matches(token, settings.admin_token)
    if not (is_read or is_admin):
        raise _unauthorized(
            "invalid_token", "the bearer token is not valid for this service", "invalid_token"
        )


def check_admin(request: Request) -> None:
    """Allow the admin token only; 403 when admin routes are disabled."""
    settings = _settings(request)
    if settings.admin_token is None:
        raise ApiError(
            403,
            "admin_disabled",
            "state-changing routes are disabled because no admin token is configured; "
            f"set {ENV_PREFIX}ADMIN_TOKEN and restart the service to enable them",
        )
    token = _presented_token(request)
    is_admin = _matches(token, settings.admin_token)
    is_read = _matches(token, settings.read_token)
    if is_admin:
        return
    if is_read:
        raise ApiError(
            403,
            "insufficient_scope",
            "the read token cannot change state; use the admin token",
            headers={"WWW-Authenticate": f'{_REALM}, error="insufficient_scope"'},
        )
    raise _unauthorized(
        "invalid_token", "the bearer token is not valid for this service", "invalid_token"
    )


async def require_read(request: Request, _: Annotated[object, Depends(bearer_scheme)]) -> None:
    """The read scope (``ReadAccess``): checked by :class:`GuardedRoute`
    before the body, or here on a route of another class."""
    if not request.scope.get(_CHECKED):
        check_read(request)


async def require_admin(request: Request, _: Annotated[object, Depends(bearer_scheme)]) -> None:
    """The admin scope (``AdminAccess``); see :func:`require_read`."""
    if not request.scope.get(_CHECKED):
        check_admin(request)


def uses(dependant: Dependant, call: Callable[..., Any]) -> bool:
    """Whether ``call`` is among the dependencies of ``dependant``."""
    return dependant.call is call or any(uses(d, call) for d in dependant.dependencies)


def _query_names(dependant: Dependant) -> set[str]:
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def check_query(request: Request, known: set[str]) -> None:
    """A misspelt query parameter is an error (422), not silently ignored, and
    so is one given twice (which would win?)."""
    names = [name for name, _ in request.query_params.multi_items()]
    unknown = sorted(set(names) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        if _query_holds_token(request):
            raise ApiError(
                422,
                "invalid_request",
                "the query string holds this service's token; send it only as "
                f"'Authorization: Bearer <token>' (URLs get logged); this route takes: {allowed}",
            )
        raise ApiError(
            422,
            "invalid_request",
            f"unknown query parameter {unknown[0]!r}; this route takes: {allowed}",
        )
    # counted once each: a request repeating a name thousands of times held
    # the event loop for seconds with names.count() per name (quadratic)
    twice = sorted(name for name, n in Counter(names).items() if n > 1)
    if twice:
        raise ApiError(
            422, "invalid_request", f"query parameter {twice[0]!r} is given more than once"
        )


def _header_names(dependant: Dependant) -> dict[bytes, str]:
    """The headers a route reads, as they come in a scope: their names as
    the route spells them."""
    names = {
        field.alias.lower().encode("latin-1"): field.alias for field in dependant.header_params
    }
    for sub in dependant.dependencies:
        names |= _header_names(sub)
    return names


def check_headers(request: Request, declared: dict[bytes, str]) -> None:
    """A header the route reads, given twice, is an error (422): the route
    would see the first only."""
    seen: set[bytes] = set()
    for name, _ in request.scope["headers"]:
        if name in declared:
            if name in seen:
                raise ApiError(
                    422, "invalid_request", f"header {declared[name]!r} is given more than once"
                )
            seen.add(name)


class GuardedRoute(APIRoute):
    """A route that decides from the request line and headers, before FastAPI
    reads and parses the body: auth first (an unauthenticated request gets
    401/403, never 400/422 for its body, and its body is never read), then
    the query's names (an unknown one is 422) and the headers it reads
    (one given twice is 422), then, on a route that is not
    a GET, the body (:func:`app.bodies.check_body`). All are plain calls,
    not dependencies: FastAPI's dependency solving costs more than the
    checks, and the GIL it holds is the engine's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        guard: Callable[[Request], None] | None = None
        if uses(self.dependant, require_admin):
            guard = check_admin
        elif uses(self.dependant, require_read):
            guard = check_read
        known = _query_names(self.dependant)
        headers = _header_names(self.dependant)
        reads_body = bool((self.methods or set()) - {"GET", "HEAD"})
        takes_body = self.body_field is not None

        async def guarded(request: Request) -> Response:
            if guard is not None:
                guard(request)
                request.scope[_CHECKED] = True
            if request.scope["query_string"]:
                check_query(request, known)
            if headers:
                check_headers(request, headers)
            if reads_body:
                await check_body(request, takes_body)
            return await handler(request)

        return guarded
