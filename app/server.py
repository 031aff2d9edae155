"""``kvoffload serve``: one process running the engine thread and the
embedded admin server until SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType

from app.application import start_engine, stop_engine
from app.embedded import StartupError, listen, start_admin_server
from app.engine_setup import preloaded_engine_factory
from app.settings import Settings
from app.telemetry import setup_telemetry
from kvoffload.errors import KVOffloadError
from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge

__all__ = [
    "EXIT_OK",
    "EXIT_STARTUP_FAILED",
    "EXIT_UNCLEAN_STOP",
    "EXIT_USAGE",
    "GIL_SWITCH_INTERVAL",
    "pin_threads",
    "serve",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_USAGE = 2
#: stopped, but the engine did not within --stop-timeout (the log says how far it got)
EXIT_UNCLEAN_STOP = 3

#: seconds a thread may hold the GIL while another waits (CPython default 5 ms)
GIL_SWITCH_INTERVAL = 0.0005


def pin_threads(engine_tid: int) -> None:
    """Put thread ``engine_tid`` on the last CPU this process may use and
    every other thread of the process, and those they start later, on the
    rest; nothing where there is nothing to do (not Linux, one CPU), a
    warning where the OS refuses.

    The admin server's thread wakes a few times per request; free to run
    anywhere, it often ran on the engine's CPU while the engine waited for
    the GIL, and the engine came back to caches the server had filled or was
    moved. On 2 cores this took 5-7% of the engine's steps at 50 requests/s
    (``bench/api.py``, docs/api.md). Our own process only: an embedding host
    keeps its affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    engine_cpu, rest = cpus[-1], set(cpus[:-1])
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    try:
        for tid in tids:
            os.sched_setaffinity(tid, {engine_cpu} if tid == engine_tid else rest)
    except OSError as exc:  # a sandbox that forbids it: run unpinned
        logger.warning("could not pin threads to CPUs (%s); running unpinned", exc)
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)
        return
    logger.info("engine thread on CPU %d, the admin server on CPUs %s", engine_cpu, sorted(rest))


def serve(settings: Settings) -> int:
    """Run the engine and its admin API until a signal. Returns the exit
    status: 0 after a clean shutdown, 1 if the server could not start or
    stopped by itself, 2 for settings or inputs that make no engine (one line
    on stderr, no traceback), 3 if the engine did not stop within
    ``stop_timeout``."""
    try:
        # Read the trace, check the engine's shape and its device now.
        factory = preloaded_engine_factory(settings)
    except KVOffloadError as exc:
        sys.stderr.write(f"kvoffload serve: error: {exc}\n")
        return EXIT_USAGE
    try:
        # the address before the engine: a port in use fails here, in one
        # line, with no engine started and stopped for nothing
        sock = listen(settings.host, settings.port)
    except StartupError as exc:
        sys.stderr.write(f"kvoffload serve: error: {exc}\n")
        return EXIT_STARTUP_FAILED
    try:
        telemetry = setup_telemetry()
        try:
            engine, prometheus = start_engine(settings, factory, telemetry)
        except BaseException:
            telemetry.shutdown()
            raise
    except KVOffloadError as exc:
        sock.close()
        sys.stderr.write(f"kvoffload serve: error: {exc}\n")
        return EXIT_USAGE
    except BaseException:
        sock.close()
        raise
    # The engine thread is busy Python; the event loop needs the GIL a few
    # times per request. With the default 5 ms interval each of those waits
    # up to 5 ms; 0.5 ms keeps answers quick and costs the engine nothing
    # while no request is waiting. Our own process only: an embedding host
    # keeps its setting.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    if settings.pin_threads and engine.thread_id is not None:
        pin_threads(engine.thread_id)
    stop = threading.Event()
    received: list[int] = []

    def note(sig: int, frame: FrameType | None) -> None:
        received.append(sig)
        stop.set()

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = EXIT_OK
    try:
        server = start_admin_server(
            engine,
            settings,
            prometheus=prometheus,
            tracer_provider=telemetry.tracer_provider,
            listening=sock,
        )
        if telemetry.meter_provider is not None:
            OTelMetricsBridge(telemetry.meter_provider, server.registry)
        while not stop.wait(0.5):
            if not server.running:
                logger.error("the admin server stopped by itself; stopping")
                code = EXIT_STARTUP_FAILED
                break
        if received:
            logger.info("stopped by %s", signal.Signals(received[0]).name)
        server.stop(settings.stop_timeout)
    except StartupError as exc:
        logger.error("%s", exc)
        code = EXIT_STARTUP_FAILED
    finally:
        if not stop_engine(engine, settings) and code == EXIT_OK:
            code = EXIT_UNCLEAN_STOP
        telemetry.shutdown()
        logger.info("shutdown complete")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
