"""The application factory and the ``kvoffload serve`` entry point.

``create_app(settings)`` returns a FastAPI application whose lifespan builds
the telemetry providers, the Prometheus registry, the engine observers and the
engine, and starts it; on shutdown it stops the engine (which finishes its
in-flight transfer jobs) and then flushes telemetry. ``run(argv)`` parses the
flags and serves it with uvicorn. Nothing is built at import time.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from app.auth import require_read
from app.engine_setup import build_engine
from app.errors import install_error_handlers
from app.flags import describe_errors, parse_settings
from app.routers import cache, events, health, policy, runtime
from app.settings import ENV_PREFIX, Settings
from app.state import ServiceState
from app.telemetry import setup_telemetry
from kvoffload._version import __version__
from kvoffload.instrumentation.prometheus import (
    KVOffloadCollector,
    PrometheusObserver,
    config_labels,
)
from kvoffload.runtime import Engine, EngineObserver

__all__ = ["EngineFactory", "create_app", "run"]

logger = logging.getLogger(__name__)

#: builds the engine from the settings and the observers the app wires in
EngineFactory = Callable[[Settings, Sequence[EngineObserver]], Engine]

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
Admin API of a running kvoffload engine: inspect the cache (policy, occupancy,
ARC lists, counters), switch the eviction policy live, pause/resume the engine,
reset the cache, and read, drain or tail the offloading event log.

Every error answer is `{"error": {"code": ..., "message": ...}}`. Read routes take the
read token (or the admin token); state-changing routes take the admin token.
"""


def create_app(
    settings: Settings | None = None,
    *,
    engine_factory: EngineFactory | None = None,
) -> FastAPI:
    """A new application; its engine is built and started by the lifespan.

    ``engine_factory`` replaces :func:`app.engine_setup.build_engine` (tests
    use it to inject a handler or a workload).
    """
    settings = settings if settings is not None else Settings()
    app = FastAPI(
        title="kvoffload admin API",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.engine_factory = engine_factory or build_engine
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
    telemetry = setup_telemetry()
    try:
        registry = CollectorRegistry(auto_describe=True)
        prometheus = PrometheusObserver(registry=registry)
        tracing = telemetry.tracing_observer()
        engine = factory(settings, (prometheus, tracing))
        tracing.watch_event_log(engine.event_log)
        KVOffloadCollector(
            engine.snapshot, registry=registry, config_info=config_labels(engine.config)
        )
        engine.start()
    except Exception as exc:
        logger.error("cannot start the engine: %s", exc)
        telemetry.shutdown()
        raise
    app.state.service = ServiceState(settings, engine, registry, stopping=stopping)
    _log_startup(settings, engine)
    try:
        yield
    finally:
        stopping.set()
        logger.info("stopping the engine; in-flight transfer jobs finish first")
        final = await asyncio.to_thread(engine.stop, settings.stop_timeout)
        m = final.manager
        logger.info(
            "engine %s at step %d after finishing in-flight jobs "
            "(in flight %d, pinned %d, used %d of %d blocks)",
            final.state,
            final.step,
            m.in_flight,
            m.pinned,
            m.used,
            m.capacity,
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


# --------------------------------------------------------------------------- serving


class _Server(uvicorn.Server):
    """uvicorn's server, telling live streams to end as soon as shutdown
    begins (uvicorn waits for open connections before the lifespan ends)."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self._stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._stopping.set()
        super().handle_exit(sig, frame)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(argv: list[str] | None = None) -> int:
    """``kvoffload serve``: parse ``argv`` (flags over ``KVOFFLOAD_*``), serve
    until SIGTERM/SIGINT, stop the engine cleanly. Returns the exit status:
    0 after a clean shutdown, 1 if startup failed, 2 on bad settings."""
    try:
        settings = parse_settings(argv)
    except ValidationError as exc:
        for line in describe_errors(exc):
            sys.stderr.write(f"kvoffload serve: error: {line}\n")
        return EXIT_USAGE
    _configure_logging(settings.log_level)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=int(settings.stop_timeout),
    )
    server = _Server(config, app.state.stopping)
    # uvicorn re-raises the signal that stopped it once it is done; catching
    # it here turns a clean, signalled shutdown into exit status 0.
    received: list[int] = []

    def note(sig: int, frame: FrameType | None) -> None:
        received.append(sig)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        return EXIT_STARTUP_FAILED
    if received:
        logger.info("stopped by %s", signal.Signals(received[0]).name)
    return EXIT_OK
