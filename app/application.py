"""The FastAPI application: routers, error handlers, limits and OpenAPI, over a
:class:`~app.state.ServiceState` (what it serves).

:func:`wire` builds that state for a target (an engine or a hosted manager):
the Prometheus registry with kvoffload's collectors, and the admin tracer.
:func:`build_app` serves a state given to it (the embedded server), or, with
none given, builds and starts an engine of its own in the lifespan and stops
it at shutdown (:func:`app.main.create_app`, for tests and
``uvicorn --factory``).

This module loads the web stack and, through the engine, torch, which
``kvoffload serve --help`` does not need.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from opentelemetry.trace import NoOpTracer, TracerProvider
from prometheus_client import CollectorRegistry

from app.auth import require_read, uses
from app.cached_reads import CachedReads
from app.engine_setup import build_engine
from app.errors import error_responses, install_error_handlers
from app.limits import RequestLimits
from app.request_metrics import RequestMetrics
from app.routers import cache, events, health, policy, runtime
from app.settings import ENV_PREFIX, Settings
from app.state import ServiceState
from app.target import AdminTarget
from app.telemetry import Telemetry, setup_telemetry
from kvoffload._version import __version__
from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge
from kvoffload.instrumentation.prometheus import (
    KVOffloadCollector,
    PrometheusObserver,
    config_labels,
)
from kvoffload.runtime import Engine, EngineObserver

__all__ = [
    "EngineFactory",
    "TelemetryFactory",
    "build_app",
    "log_access",
    "start_engine",
    "stop_engine",
    "wire",
]

logger = logging.getLogger(__name__)

#: builds the engine from the settings and the observers the app wires in
EngineFactory = Callable[[Settings, Sequence[EngineObserver]], Engine]
#: builds the telemetry providers (default: from the OTEL_* environment)
TelemetryFactory = Callable[[], Telemetry]

_DESCRIPTION = """\
Admin API of a running kvoffload engine (or of a manager a host process drives):
inspect the cache (policy, occupancy, policy lists such as ARC's and kvarc's
T1/T2/B1/B2, counters), switch the eviction policy live, pause/resume the engine,
reset the cache, and read, drain or tail the offloading event log.

Every error answer is `{"error": {"code": ..., "message": ...}}`. Read routes take the
read token (or the admin token); state-changing routes take the admin token.
"""


def wire(
    target: AdminTarget,
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    prometheus: PrometheusObserver | None = None,
    tracer_provider: TracerProvider | None = None,
) -> ServiceState:
    """What the routes of ``target`` read: ``registry`` (default: a new one)
    with kvoffload's snapshot collector and ``prometheus`` (default: a new
    observer; it must not be registered yet) registered on it, and a tracer
    for admin actions from ``tracer_provider`` (none: no spans)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    prometheus = prometheus if prometheus is not None else PrometheusObserver()
    registry.register(prometheus)
    KVOffloadCollector(
        target.snapshot,
        registry=registry,
        config_info=config_labels(target.config),
        event_log=target.event_log,
    )
    tracer = (
        tracer_provider.get_tracer("kvoffload.admin", __version__)
        if tracer_provider is not None
        else NoOpTracer()
    )
    return ServiceState(settings, target, registry, prometheus, tracer=tracer)


def build_app(
    settings: Settings,
    service: ServiceState | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    telemetry_factory: TelemetryFactory | None = None,
) -> FastAPI:
    """The application serving ``service``; with ``service=None`` its
    lifespan builds one around an engine of its own (see
    :func:`app.main.create_app`)."""
    app = FastAPI(
        title="kvoffload admin API",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=_owned_engine if service is None else None,
        # every route may reject a request (an unknown query parameter:
        # app.auth.GuardedRoute)
        responses=error_responses(422),
        # a target is routed as written: /v1/cache/ is not /v1/cache
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.engine_factory = engine_factory or build_engine
    app.state.telemetry_factory = telemetry_factory or setup_telemetry
    # the last added is the outermost: the API's metrics (every answer
    # counted), the limits, then the cached reads
    app.add_middleware(CachedReads)
    app.add_middleware(
        RequestLimits, max_bytes=settings.max_body_bytes, body_timeout=settings.body_timeout
    )
    app.add_middleware(RequestMetrics)
    install_error_handlers(app)
    routers = [module.router for module in (cache, policy, events, runtime, health)]
    for router in routers:
        app.include_router(router)
    # Included without a prefix, so each route's path is the served path.
    api_routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    app.state.api_routes = api_routes
    _install_openapi(app, settings, api_routes)
    return app


# --------------------------------------------------------------------------- an engine of its own


def start_engine(
    settings: Settings, factory: EngineFactory, telemetry: Telemetry
) -> tuple[Engine, PrometheusObserver]:
    """Build the engine with its Prometheus and tracing observers and start
    it; raises the library's error when the settings do not make an engine."""
    tracing = telemetry.tracing_observer()
    # the step and transfer histograms carry the trace of sampled steps
    prometheus = PrometheusObserver(exemplars=tracing.exemplar)
    engine = factory(settings, (prometheus, tracing))
    tracing.watch_event_log(engine.event_log)
    engine.start()
    logger.info(
        "engine running: policy %s, %d CPU blocks of %d tokens, workload: %s",
        settings.policy,
        settings.num_cpu_blocks,
        settings.offloaded_block_size,
        engine.workload_description,
    )
    return engine, prometheus


def stop_engine(engine: Engine, settings: Settings) -> bool:
    """Stop ``engine`` (in-flight jobs finish first), say how it ended, and
    answer whether it stopped cleanly."""
    logger.info("stopping the engine; in-flight transfer jobs finish first")
    final = engine.stop(settings.stop_timeout)
    m = final.manager
    if final.state == "stopped" and m.in_flight == 0:
        logger.info(
            "engine stopped at step %d after finishing in-flight jobs "
            "(pinned %d, used %d of %d blocks)",
            final.step,
            m.pinned,
            m.used,
            m.capacity,
        )
        return True
    logger.error(
        "engine did not stop cleanly within %.1f s: state %s, %d blocks in flight",
        settings.stop_timeout,
        final.state,
        m.in_flight,
    )
    return False


def log_access(settings: Settings, where: str) -> None:
    """Say at start who may do what."""
    if settings.admin_token is None:
        logger.warning(
            "no admin token (%sADMIN_TOKEN) configured: state-changing routes are disabled "
            "(403), and kvoffload serve binds to loopback only (%s; a server of your own, "
            "such as uvicorn --factory, binds where you tell it)",
            ENV_PREFIX,
            settings.host,
        )
    if settings.read_token is None:
        logger.info(
            "no read token (%sREAD_TOKEN) configured: read routes are open to anyone who "
            "can reach %s",
            ENV_PREFIX,
            where,
        )


@asynccontextmanager
async def _owned_engine(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    try:
        telemetry: Telemetry = app.state.telemetry_factory()
    except Exception as exc:
        logger.error("cannot set up telemetry: %s", exc)
        raise
    try:
        engine, prometheus = start_engine(settings, app.state.engine_factory, telemetry)
    except Exception as exc:
        logger.error("cannot start the engine: %s", exc)
        telemetry.shutdown()
        raise
    service = wire(
        engine, settings, prometheus=prometheus, tracer_provider=telemetry.tracer_provider
    )
    if telemetry.meter_provider is not None:
        app.state.otel_metrics = OTelMetricsBridge(telemetry.meter_provider, service.registry)
    app.state.service = service
    log_access(settings, f"{settings.host}:{settings.port}")
    try:
        yield
    finally:
        service.stopping.set()
        await asyncio.to_thread(stop_engine, engine, settings)
        telemetry.shutdown()
        logger.info("shutdown complete")


# --------------------------------------------------------------------------- OpenAPI


def _install_openapi(app: FastAPI, settings: Settings, api_routes: Sequence[APIRoute]) -> None:
    """Generate the schema once, and drop the security requirement of read
    routes when reads are open (so the document says what the server does)."""
    open_reads: set[tuple[str, str]] = set()
    if settings.read_token is None:
        for route in api_routes:
            if uses(route.dependant, require_read):
                open_reads.update((route.path, m.lower()) for m in route.methods or ())

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                description=app.description,
                routes=app.routes,
            )
            for path, operations in schema.get("paths", {}).items():
                for method, operation in operations.items():
                    if (path, method) in open_reads:
                        operation.pop("security", None)
                    body = operation.get("requestBody", {})
                    if body.get("required"):
                        # a body that must be sent has no default (reset's
                        # would be {"confirm": false}, which it refuses)
                        for media in body.get("content", {}).values():
                            media.get("schema", {}).pop("default", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
