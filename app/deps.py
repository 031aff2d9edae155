"""Dependencies of the routes, as ``Annotated`` aliases.

Every dependency is ``async`` although none awaits: FastAPI runs plain
functions in its threadpool, and a thread hop per dependency would cost more
than the work (and contend for the GIL with the engine thread).

``ReadAccess`` / ``AdminAccess`` guard a route (checked before the body by
:class:`~app.auth.GuardedRoute`); ``ServiceDep`` / ``EventLogDep`` hand it
what the service serves.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from app.auth import require_admin, require_read
from app.errors import ApiError
from app.state import ServiceState
from kvoffload.event_log import EventLog

__all__ = [
    "AdminAccess",
    "EventLogDep",
    "ReadAccess",
    "ServiceDep",
    "reject_unknown_query_params",
]


def _query_names(dependant: Dependant) -> set[str]:
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def reject_unknown_query_params(request: Request) -> None:
    """A misspelt query parameter is an error, not silently ignored."""
    if not request.query_params:
        return
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known = _query_names(route.dependant)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise ApiError(
            422,
            "invalid_request",
            f"unknown query parameter {unknown[0]!r}; this route takes: {allowed}",
        )


async def get_service(request: Request) -> ServiceState:
    service: ServiceState | None = getattr(request.app.state, "service", None)
    if service is None:
        raise ApiError(503, "not_ready", "the service is starting or stopping; retry shortly")
    return service


async def get_event_log(service: Annotated[ServiceState, Depends(get_service)]) -> EventLog:
    log = service.target.event_log
    if log is None:
        raise ApiError(
            409,
            "events_disabled",
            "this manager records no events (it was created with enable_events=False)",
        )
    return log


ServiceDep = Annotated[ServiceState, Depends(get_service)]
EventLogDep = Annotated[EventLog, Depends(get_event_log)]
ReadAccess = Annotated[None, Depends(require_read)]
AdminAccess = Annotated[None, Depends(require_admin)]
