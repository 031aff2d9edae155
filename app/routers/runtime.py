"""Pausing and resuming the engine loop (409 ``not_supported`` for a hosted
manager, which the host's scheduler drives)."""

from __future__ import annotations

from fastapi import APIRouter

from app.auth import GuardedRoute
from app.commands import apply
from app.deps import AdminAccess, ServiceDep
from app.errors import error_responses
from app.models import CommandView

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["runtime"], route_class=GuardedRoute)

_RESPONSES = error_responses(400, 401, 403, 408, 409, 413, 415, 422, 503, 504)


@router.post(
    "/runtime:pause",
    response_model=CommandView,
    summary="Pause the engine between steps (in-flight jobs finish); idempotent",
    responses=_RESPONSES,
)
async def pause(_: AdminAccess, service: ServiceDep) -> CommandView:
    result, snap = await apply(service, "pause", service.target.pause)
    return CommandView.from_result(result, snap.state)


@router.post(
    "/runtime:resume",
    response_model=CommandView,
    summary="Resume a paused engine; idempotent",
    responses=_RESPONSES,
)
async def resume(_: AdminAccess, service: ServiceDep) -> CommandView:
    result, snap = await apply(service, "resume", service.target.resume)
    return CommandView.from_result(result, snap.state)
