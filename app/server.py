"""Serving an application with uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from app.front import FrontProxy
from app.settings import Settings

__all__ = ["serve", "serve_with_front"]

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
        uds=settings.uds,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=int(settings.stop_timeout),
    )
    return _run(_Server(config, app.state.stopping))


def _run(server: uvicorn.Server) -> bool:
    """Run ``server`` until a signal; whether it started."""
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


class _FrontServer(uvicorn.Server):
    """The front's server: a signal is passed on to the engine's process at
    once, so that its live streams end and the front's shutdown, which waits
    for open connections, does not wait for them in vain."""

    def __init__(self, config: uvicorn.Config, engine: subprocess.Popen[bytes]) -> None:
        super().__init__(config)
        self._engine = engine
        self.engine_signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stop_engine()
        super().handle_exit(sig, frame)

    def stop_engine(self) -> None:
        """Ask the engine's process to stop, once: a second signal during its
        clean shutdown could arrive after its handlers are gone and kill it."""
        if not self.engine_signalled and self._engine.poll() is None:
            self.engine_signalled = True
            self._engine.send_signal(signal.SIGTERM)


def serve_with_front(settings: Settings, argv: Sequence[str]) -> int:
    """``kvoffload serve`` in two processes (see :mod:`app.front`): the engine
    and the whole API in a child process on a private Unix socket, this
    process answering HTTP on ``settings.host:port``. Returns the exit status:
    the engine process's, or 1 if the front could not start."""
    workdir = tempfile.mkdtemp(prefix="kvoffload-")
    uds = os.path.join(workdir, "engine.sock")
    env = {**os.environ, "KVOFFLOAD_UDS": uds, "KVOFFLOAD_FRONT_PROXY": "false"}
    # Its own session: a terminal's Ctrl-C reaches only the front, which then
    # stops the engine once (a second signal would make uvicorn skip the
    # clean shutdown).
    engine = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "serve", *argv], env=env, start_new_session=True
    )
    try:
        while not os.path.exists(uds) and engine.poll() is None:
            time.sleep(0.05)
        if engine.poll() is not None:
            return engine.returncode or 1
        logger.info("engine process %d listening on %s", engine.pid, uds)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        config = uvicorn.Config(
            FrontProxy(uds, settings),
            host=settings.host,
            port=settings.port,
            log_config=None,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            lifespan="on",
            timeout_graceful_shutdown=int(settings.stop_timeout) + 5,
        )
        server = _FrontServer(config, engine)

        def watch() -> None:  # the engine process died: stop the front too
            engine.wait()
            server.should_exit = True

        threading.Thread(target=watch, name="kvoffload-engine-watch", daemon=True).start()
        started = _run(server)
        server.stop_engine()
        try:
            code = engine.wait(settings.stop_timeout + 10)
        except subprocess.TimeoutExpired:
            logger.error("engine process %d did not stop; killing it", engine.pid)
            engine.kill()
            code = engine.wait()
        if not started or code < 0:  # a negative code: killed by a signal
            return 1
        return code
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        shutil.rmtree(workdir, ignore_errors=True)
