"""Serving an application with uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from app.settings import Settings

__all__ = ["serve"]

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, telling live streams to end as soon as shutdown
    begins (uvicorn waits for open connections before the lifespan ends)."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self._stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._stopping.set()
        super().handle_exit(sig, frame)


#: seconds a thread may hold the GIL while another waits (CPython default 5 ms)
GIL_SWITCH_INTERVAL = 0.0005


def serve(app: FastAPI, settings: Settings) -> bool:
    """Serve ``app`` on ``settings.host:port`` until a signal; ``False`` if it
    never started (the reason is logged)."""
    # The engine thread is busy Python; the event loop needs the GIL a few
    # times per request. With the default 5 ms interval each of those waits
    # up to 5 ms, capping the service near 100 requests/s and stretching
    # latency; 0.5 ms keeps requests quick and costs the engine nothing
    # while no request is waiting.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
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
    # it here turns a clean, signalled shutdown into a normal return.
    received: list[int] = []

    def note(sig: int, frame: FrameType | None) -> None:
        received.append(sig)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit:
        # uvicorn exits by itself when it cannot bind or the lifespan fails
        # (it has logged why); report a failed start instead.
        return False
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        logger.info("stopped by %s", signal.Signals(received[0]).name)
    return server.started
