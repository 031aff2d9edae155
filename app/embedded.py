"""The admin server as a component of any host process.

:func:`start_admin_server` serves the admin API and ``/metrics`` for a target
(the runtime's :class:`~kvoffload.runtime.Engine`, or a
:class:`~kvoffload.runtime.HostedManager` around a manager someone else's
scheduler drives) on a background thread with its own event loop, and
returns an :class:`AdminServer` to stop it with. ``kvoffload serve`` runs its
engine this way; so can a serving engine that embeds kvoffload.

The host's process-wide settings are left alone: no signal handlers, no
logging configuration (uvicorn's loggers log through the host's), no change
to the GIL switch interval.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from app.application import build_app, log_access, wire
from app.limits import header_timeout_protocol
from app.settings import Settings
from app.state import ServiceState
from app.target import AdminTarget
from kvoffload.instrumentation.prometheus import PrometheusObserver

__all__ = ["AdminServer", "StartupError", "start_admin_server"]

logger = logging.getLogger(__name__)

#: seconds an idle keep-alive connection stays open
KEEP_ALIVE_S = 5


#: query parameters the access log shows; every other one is masked, name
#: and value (a client may have put its token in ``?access_token=``, or
#: made it the name: ``?<token>``)
_LOGGED_QUERY = frozenset({"after_seq", "limit"})


class _MaskQuery(logging.Filter):
    """Masks the query parameters the API does not take in uvicorn's access
    log lines (``'%s - "%s %s HTTP/%s" %d'``: the target is the third argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and "?" in str(args[2]):
            path, _, query = str(args[2]).partition("?")
            masked = "&".join(
                part if part.partition("=")[0] in _LOGGED_QUERY else "***"
                for part in query.split("&")
            )
            record.args = (*args[:2], f"{path}?{masked}", *args[3:])
        return True


def _mask_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _MaskQuery) for f in access.filters):
        access.addFilter(_MaskQuery())


class StartupError(RuntimeError):
    """The admin server could not start (address in use, unknown host...)."""


class AdminServer:
    """A running admin server (see :func:`start_admin_server`)."""

    def __init__(
        self, service: ServiceState, server: uvicorn.Server, thread: threading.Thread, url: str
    ) -> None:
        self.service = service
        self.url = url
        self.port: int = int(url.rsplit(":", 1)[1])
        self._server = server
        self._thread = thread

    @property
    def registry(self) -> CollectorRegistry:
        """kvoffload's collectors; a host may register its own on it."""
        return self.service.registry

    @property
    def prometheus(self) -> PrometheusObserver:
        """Feed it the host's worker-side
        :class:`~kvoffload.runtime.TransferRecord` s (``transfer_finished``)
        for the transfer histograms of ``/metrics``."""
        return self.service.prometheus

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """End live event streams, stop accepting connections, let answers
        in progress finish (at most ``timeout`` seconds) and join the thread.
        Idempotent. The target itself is not stopped."""
        self.service.stopping.set()
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("admin server did not stop within %.1f s; closing connections", timeout)
            self._server.force_exit = True
            self._thread.join(1.0)


def start_admin_server(
    target: AdminTarget,
    settings: Settings | None = None,
    *,
    registry: CollectorRegistry | None = None,
    prometheus: PrometheusObserver | None = None,
    tracer_provider: TracerProvider | None = None,
    startup_timeout: float = 30.0,
    listening: socket.socket | None = None,
) -> AdminServer:
    """Serve the admin API for ``target`` on ``settings.host:settings.port``
    (``port=0``: a free port, see :attr:`AdminServer.port`) from a background
    thread, and return once it accepts connections.

    ``settings`` default to the ``KVOFFLOAD_*`` environment; only the
    service's fields (address, tokens, limits, timeouts) matter here.
    ``registry``, ``prometheus`` and ``tracer_provider`` are as in
    :func:`app.application.wire`. ``listening``: a socket bound to the
    address already (:func:`listen`), served instead of binding one here.
    Raises :class:`StartupError` when the address cannot be used.
    """
    settings = settings if settings is not None else Settings()
    service = wire(
        target,
        settings,
        registry=registry,
        prometheus=prometheus,
        tracer_provider=tracer_provider,
    )
    sock = listening if listening is not None else listen(settings.host, settings.port)
    _mask_access_log()
    config = uvicorn.Config(
        build_app(settings, service),
        http=header_timeout_protocol(settings.header_timeout, settings.max_header_bytes),
        ws="none",
        lifespan="off",
        # nothing in front is trusted to say who the client is
        proxy_headers=False,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=max(1, round(settings.stop_timeout)),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="kvoffload-admin", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise StartupError("the admin server did not start; its log says why")
        time.sleep(0.01)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    logger.info("admin API listening on %s", url)
    log_access(settings, url)
    return AdminServer(service, server, thread, url)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``: a bad address fails here, in the
    caller's thread, with a message that says which."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
