"""Bearer-token auth with two scopes.

- **read** (GET routes): the read token or the admin token; open to everyone
  when no read token is configured.
- **admin** (everything that changes state): the admin token only; with no
  admin token configured these routes are disabled (403).

Tokens are compared in constant time and never logged. 401 (with
``WWW-Authenticate: Bearer``) means "who are you?": no, malformed or unknown
token. 403 means "I know you, but no": the read token on an admin route, or
admin routes disabled.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from pydantic import SecretStr

from app.errors import ApiError
from app.settings import ENV_PREFIX, Settings

__all__ = ["bearer_scheme", "reads_allowed", "require_admin", "require_read"]

#: declares the scheme in OpenAPI (the "Authorize" button of /docs); the
#: checks below read the header themselves to tell missing from malformed.
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="`Authorization: Bearer <token>`: the read token for GET routes, "
    "the admin token for everything (it is valid for reads too)",
)

_REALM = 'Bearer realm="kvoffload"'


def _unauthorized(code: str, message: str, error: str | None = None) -> ApiError:
    challenge = f'{_REALM}, error="{error}"' if error else _REALM
    return ApiError(401, code, message, headers={"WWW-Authenticate": challenge})


def _presented_token(request: Request) -> str:
    """The bearer token of the request; 401 when absent or malformed."""
    header = request.headers.get("authorization")
    if header is None:
        raise _unauthorized(
            "missing_token",
            "this route needs a bearer token: send 'Authorization: Bearer <token>'",
        )
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


def reads_allowed(authorization: str | None, settings: Settings) -> bool:
    """Whether a request with this ``Authorization`` header may read: the
    yes/no of :func:`require_read` without its detailed 401 answers."""
    if settings.read_token is None:
        return True
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        return False
    is_read = _matches(token, settings.read_token)
    is_admin = _matches(token, settings.admin_token)
    return is_read or is_admin


async def require_read(request: Request, _: Annotated[object, Depends(bearer_scheme)]) -> None:
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


async def require_admin(request: Request, _: Annotated[object, Depends(bearer_scheme)]) -> None:
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
