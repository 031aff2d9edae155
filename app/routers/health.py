"""Probes and the Prometheus scrape endpoint."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from app.auth import GuardedRoute
from app.deps import ReadAccess, ServiceDep
from app.errors import error_responses
from app.models import HealthView
from app.state import METRICS_FORMATS, metrics_format

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
    summary="Prometheus metrics (text format, or OpenMetrics with exemplars)",
    description="The text exposition format; OpenMetrics when the Accept header prefers it "
    "(Prometheus' does), with exemplars: the trace of a sampled engine step in the step and "
    "transfer histograms' buckets.",
    response_class=Response,
    responses={
        200: {
            "content": {
                media: {"schema": {"type": "string"}} for media, _ in METRICS_FORMATS.values()
            }
        },
        **error_responses(401),
    },
)
async def metrics(request: Request, _: ReadAccess, service: ServiceDep) -> Response:
    # Rendering costs about a millisecond of the engine's GIL time; see
    # MetricsCache for when the last rendering is reused. (A plain GET is
    # usually answered before it gets here: app.cached_reads.)
    fmt = metrics_format(request.headers.get("accept"))
    return Response(service.metrics_text(fmt), media_type=METRICS_FORMATS[fmt][0])
