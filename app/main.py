"""The application factory and the ``kvoffload serve`` entry point.

``create_app(settings)`` returns a FastAPI application whose lifespan builds
the telemetry providers, the Prometheus registry, the engine observers and the
engine, and starts it; on shutdown it stops the engine (which finishes its
in-flight transfer jobs) and then flushes telemetry (tests, ``uvicorn
--factory``). ``run(argv)`` parses the flags and runs the engine with the
embedded admin server (:mod:`app.server`). Nothing is built at import time.

The web stack and the engine (torch) are imported when first needed, so that
``kvoffload serve --help`` and a settings error answer at once.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from app.flags import describe_errors, parse_settings, unknown_variables
from app.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.application import EngineFactory, TelemetryFactory

__all__ = ["create_app", "run"]

EXIT_USAGE = 2


def create_app(
    settings: Settings | None = None,
    *,
    engine_factory: EngineFactory | None = None,
    telemetry_factory: TelemetryFactory | None = None,
) -> FastAPI:
    """A new application; its engine is built and started by the lifespan.

    ``settings`` default to the ``KVOFFLOAD_*`` environment.
    ``engine_factory(settings, observers)`` replaces
    :func:`app.engine_setup.build_engine` (to inject a workload or a handler);
    ``telemetry_factory()`` replaces :func:`app.telemetry.setup_telemetry`
    (to export to an in-memory exporter in tests).
    """
    from app.application import build_app

    return build_app(
        settings if settings is not None else Settings(),
        engine_factory=engine_factory,
        telemetry_factory=telemetry_factory,
    )


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(argv: list[str] | None = None) -> int:
    """``kvoffload serve``: parse ``argv`` (flags over ``KVOFFLOAD_*``), serve
    until SIGTERM/SIGINT, stop the engine cleanly. Returns the exit status:
    0 after a clean shutdown, 1 if the server could not start (e.g. port in
    use), 2 on bad settings or inputs (e.g. an unreadable trace)."""
    try:
        settings = parse_settings(argv)
    except ValidationError as exc:
        for line in describe_errors(exc):
            sys.stderr.write(f"kvoffload serve: error: {line}\n")
        return EXIT_USAGE
    for line in unknown_variables(os.environ):
        sys.stderr.write(f"kvoffload serve: warning: {line}\n")
    _configure_logging(settings.log_level)
    from app.server import serve

    return serve(settings)
