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

from app.auth import require_admin, require_read
from app.errors import ApiError
from app.state import ServiceState
from kvoffload.event_log import EventLog

__all__ = [
    "AdminAccess",
    "EventLogDep",
    "ReadAccess",
    "ServiceDep",
]


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
