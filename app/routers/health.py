"""Probes and the Prometheus scrape endpoint."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from app.auth import GuardedRoute
from app.deps import ReadAccess, ServiceDep
from app.errors import error_responses
from app.models import HealthView

__all__ = ["router"]

router = APIRouter(tags=["health"], route_class=GuardedRoute)

#: engine states in which the service does its job (a finished, non-looping
#: replay still answers every route)
_READY_STATES = frozenset({"running", "paused", "finished"})


@router.get("/livez", response_model=HealthView, summary="Liveness: the process answers")
async def livez() -> HealthView:
    return HealthView(status="ok")


@router.get(
    "/readyz",
    response_model=HealthView,
    summary="Readiness: the engine (or hosted manager) is running",
    responses={503: {"model": HealthView, "description": "The engine is not running"}},
)
async def readyz(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    if service is None:
        view = HealthView(status="unavailable", detail="the engine is not started")
        return JSONResponse(view.model_dump(mode="json"), status_code=503)
    state = service.target.state
    if service.stopping.is_set():
        view = HealthView(status="unavailable", state=state, detail="the service is stopping")
        return JSONResponse(view.model_dump(mode="json"), status_code=503)
    if state not in _READY_STATES:
        view = HealthView(status="unavailable", state=state, detail=f"the engine is {state}")
        return JSONResponse(view.model_dump(mode="json"), status_code=503)
    return JSONResponse(HealthView(status="ok", state=state).model_dump(mode="json"))


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
        **error_responses(401),
    },
)
async def metrics(_: ReadAccess, service: ServiceDep) -> Response:
    # Rendering costs about a millisecond of the engine's GIL time; see
    # MetricsCache for when the last rendering is reused. (A plain GET is
    # usually answered before it gets here: app.cached_reads.)
    return Response(service.metrics_text(), media_type=CONTENT_TYPE_LATEST)
