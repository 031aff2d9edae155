"""The FastAPI application: routers, error handlers, OpenAPI, and the lifespan
that builds telemetry, the Prometheus registry, the observers and the engine.

Use :func:`app.main.create_app`; this module loads the web stack and the
engine (torch), which ``kvoffload serve --help`` does not need.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from opentelemetry.trace import NoOpTracer
from prometheus_client import CollectorRegistry

from app.auth import require_read
from app.deps import reject_unknown_query_params
from app.engine_setup import build_engine
from app.errors import error_responses, install_error_handlers
from app.routers import cache, events, health, policy, runtime
from app.settings import ENV_PREFIX, Settings
from app.state import ServiceState
from app.telemetry import Telemetry, setup_telemetry
from kvoffload._version import __version__
from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge
from kvoffload.instrumentation.prometheus import (
    KVOffloadCollector,
    PrometheusObserver,
    config_labels,
)
from kvoffload.runtime import Engine, EngineObserver

__all__ = ["EngineFactory", "TelemetryFactory", "build_app"]

logger = logging.getLogger(__name__)

#: builds the engine from the settings and the observers the app wires in
EngineFactory = Callable[[Settings, Sequence[EngineObserver]], Engine]

_DESCRIPTION = """\
Admin API of a running kvoffload engine: inspect the cache (policy, occupancy,
policy lists such as ARC's and kvarc's T1/T2/B1/B2, counters), switch the eviction policy live, pause/resume the engine,
reset the cache, and read, drain or tail the offloading event log.

Every error answer is `{"error": {"code": ..., "message": ...}}`. Read routes take the
read token (or the admin token); state-changing routes take the admin token.
"""


#: builds the telemetry providers (default: from the OTEL_* environment)
TelemetryFactory = Callable[[], Telemetry]


def build_app(
    settings: Settings,
    engine_factory: EngineFactory | None = None,
    telemetry_factory: TelemetryFactory | None = None,
) -> FastAPI:
    """See :func:`app.main.create_app`."""
    app = FastAPI(
        title="kvoffload admin API",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=_lifespan,
        dependencies=[Depends(reject_unknown_query_params)],
        # every route may reject a request (e.g. an unknown query parameter)
        responses=error_responses(422),
    )
    app.state.settings = settings
    app.state.engine_factory = engine_factory or build_engine
    app.state.telemetry_factory = telemetry_factory or setup_telemetry
    app.state.stopping = threading.Event()
    app.state.service = None
    install_error_handlers(app)
    routers = [module.router for module in (cache, policy, events, runtime, health)]
    for router in routers:
        app.include_router(router)
    # Included without a prefix, so each route's path is the served path.
    api_routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    app.state.api_routes = api_routes
    _install_openapi(app, settings, api_routes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    factory: EngineFactory = app.state.engine_factory
    stopping: threading.Event = app.state.stopping
    stopping.clear()
    telemetry: Telemetry = app.state.telemetry_factory()
    try:
        registry = CollectorRegistry(auto_describe=True)
        prometheus = PrometheusObserver(registry=registry)
        tracing = telemetry.tracing_observer()
        engine = factory(settings, (prometheus, tracing))
        tracing.watch_event_log(engine.event_log)
        KVOffloadCollector(
            engine.snapshot, registry=registry, config_info=config_labels(engine.config)
        )
        if telemetry.meter_provider is not None:
            app.state.otel_metrics = OTelMetricsBridge(telemetry.meter_provider, registry)
        engine.start()
    except Exception as exc:
        logger.error("cannot start the engine: %s", exc)
        telemetry.shutdown()
        raise
    tracer = (
        telemetry.tracer_provider.get_tracer("kvoffload.admin", __version__)
        if telemetry.tracer_provider is not None
        else NoOpTracer()
    )
    app.state.service = ServiceState(settings, engine, registry, stopping=stopping, tracer=tracer)
    _log_startup(settings, engine)
    try:
        yield
    finally:
        stopping.set()
        logger.info("stopping the engine; in-flight transfer jobs finish first")
        final = await asyncio.to_thread(engine.stop, settings.stop_timeout)
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
        else:
            logger.error(
                "engine did not stop cleanly within %.1f s: state %s, %d blocks in flight",
                settings.stop_timeout,
                final.state,
                m.in_flight,
            )
        telemetry.shutdown()
        logger.info("telemetry flushed; shutdown complete")


def _log_startup(settings: Settings, engine: Engine) -> None:
    logger.info(
        "engine running: policy %s, %d CPU blocks of %d tokens, workload: %s",
        settings.policy,
        settings.capacity,
        settings.offloaded_block_size,
        engine.workload_description,
    )
    if settings.admin_token is None:
        logger.warning(
            "no admin token (%sADMIN_TOKEN) configured: state-changing routes are disabled "
            "(403) and the service binds to loopback only (%s)",
            ENV_PREFIX,
            settings.host,
        )
    if settings.read_token is None:
        logger.info(
            "no read token (%sREAD_TOKEN) configured: read routes are open to anyone who "
            "can reach %s:%d",
            ENV_PREFIX,
            settings.host,
            settings.port,
        )


# --------------------------------------------------------------------------- OpenAPI


def _uses(dependant: Dependant, call: Callable[..., Any]) -> bool:
    return dependant.call is call or any(_uses(d, call) for d in dependant.dependencies)


def _install_openapi(app: FastAPI, settings: Settings, api_routes: Sequence[APIRoute]) -> None:
    """Generate the schema once, and drop the security requirement of read
    routes when reads are open (so the document says what the server does)."""
    open_reads: set[tuple[str, str]] = set()
    if settings.read_token is None:
        for route in api_routes:
            if _uses(route.dependant, require_read):
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
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
