"""The cache as a whole: one consistent view, and the guarded reset."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Response

from app.auth import GuardedRoute
from app.cached_reads import CACHE_MEDIA_TYPE
from app.commands import apply
from app.deps import AdminAccess, ReadAccess, ServiceDep
from app.errors import ApiError, error_responses
from app.models import CacheView, CommandView, ResetRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["cache"], route_class=GuardedRoute)


@router.get(
    "/cache",
    response_model=CacheView,
    summary="Policy, block counts, policy lists, counters and hit ratio from one snapshot",
    responses=error_responses(401),
)
async def get_cache(_: ReadAccess, service: ServiceDep) -> Response:
    # Handlers only read the snapshot the target published (no lock is shared
    # with the engine loop) and the event log's counts; equal views are
    # served from one encoding. (A plain GET is usually answered before it
    # gets here: app.cached_reads.)
    return Response(service.cache_json(), media_type=CACHE_MEDIA_TYPE)


@router.post(
    "/cache:reset",
    response_model=CommandView,
    summary="Evict every resident block not in use and forget the policy's ghosts",
    description='Destructive: the body must be `{"confirm": true}`. Pinned blocks and '
    "stores in flight are kept; counters continue.",
    responses=error_responses(400, 401, 403, 408, 413, 415, 422, 503, 504),
    # required, as the schema says; without one the answer is confirmation_required
    openapi_extra={"requestBody": {"required": True}},
)
async def reset_cache(
    _: AdminAccess,
    service: ServiceDep,
    body: Annotated[ResetRequest, Body()] = ResetRequest(),  # noqa: B008 (read only)
) -> CommandView:
    if body.confirm is not True:
        raise ApiError(
            422,
            "confirmation_required",
            'reset drops every cached block that is not in use; send {"confirm": true} to do it',
        )
    result, snap = await apply(service, "reset", service.target.reset)
    return CommandView.from_result(result, snap.state)
