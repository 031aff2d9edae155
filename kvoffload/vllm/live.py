"""What :class:`~kvoffload.vllm.KVOffloadSpec` built in this process.

vLLM creates one spec for the scheduler side (it asks for the manager) and
one for each worker (they ask for the handlers); with vLLM's in-process
executor both live in the engine-core process. This registry is how the two
sides, and a test or an embedding host, find each other there: the managers
vLLM drives, the handlers its workers copy with, the admin servers
(``admin_port``), and the listeners every finished transfer job is reported
to (as a :class:`~kvoffload.runtime.observer.TransferRecord`). A worker in
another process has its own registry: listeners added here never hear of its
jobs.

Managers, handlers and servers are held weakly, so an engine that is gone
leaves nothing behind.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvoffload.manager import PolicyOffloadingManager
from kvoffload.runtime.observer import TransferRecord

if TYPE_CHECKING:
    from app.embedded import AdminServer
    from kvoffload.runtime.hosted import HostedManager
    from kvoffload.vllm.handler import ReportingHandler

__all__ = [
    "TransferListener",
    "add_admin_server",
    "add_handler",
    "add_manager",
    "add_transfer_listener",
    "live_admin_servers",
    "live_handlers",
    "live_managers",
    "report",
]

logger = logging.getLogger(__name__)

TransferListener = Callable[[TransferRecord], None]
_T = TypeVar("_T")

_lock = threading.Lock()
_managers: list[weakref.ref[PolicyOffloadingManager | HostedManager]] = []
# (handler, id of the vLLM config its spec was built from)
_handlers: list[tuple[weakref.ref[ReportingHandler], int]] = []
_servers: list[weakref.ref[AdminServer]] = []
_listeners: tuple[TransferListener, ...] = ()


def _alive(refs: list[weakref.ref[_T]]) -> list[_T]:
    refs[:] = [ref for ref in refs if ref() is not None]
    return [obj for ref in refs if (obj := ref()) is not None]


def add_manager(manager: PolicyOffloadingManager | HostedManager) -> None:
    with _lock:
        _managers.append(weakref.ref(manager))


def add_handler(handler: ReportingHandler, vllm_config: object = None) -> None:
    """``vllm_config``: the config of the handler's engine; vLLM hands one
    object to the engine core and the workers it runs in its process."""
    with _lock:
        _handlers.append((weakref.ref(handler), id(vllm_config)))


def add_admin_server(server: AdminServer) -> None:
    with _lock:
        _servers.append(weakref.ref(server))


def live_managers() -> list[PolicyOffloadingManager | HostedManager]:
    """The managers vLLM's schedulers in this process drive, oldest first:
    with ``admin_port`` the :class:`~kvoffload.vllm.admin.VLLMHostedManager`
    around the manager, else the manager itself."""
    with _lock:
        return _alive(_managers)


def live_admin_servers() -> list[AdminServer]:
    """The admin servers (``admin_port``) running in this process, oldest
    first; ``.url`` and ``.port`` say where each listens."""
    with _lock:
        return [server for server in _alive(_servers) if server.running]


def live_handlers(vllm_config: object = None) -> list[ReportingHandler]:
    """Worker-side handlers alive in this process, oldest first; with
    ``vllm_config``, only those of that engine."""
    with _lock:
        _handlers[:] = [(ref, owner) for ref, owner in _handlers if ref() is not None]
        return [
            h
            for ref, owner in _handlers
            if (h := ref()) is not None and (vllm_config is None or owner == id(vllm_config))
        ]


def add_transfer_listener(listener: TransferListener) -> Callable[[], None]:
    """Report every transfer job finished in this process to ``listener``,
    from the worker's thread, as it is polled. Returns a function that removes
    it again. A listener must be cheap; one that raises is logged and skipped."""
    global _listeners
    with _lock:
        _listeners = (*_listeners, listener)

    def remove() -> None:
        global _listeners
        with _lock:
            _listeners = tuple(fn for fn in _listeners if fn is not listener)

    return remove


def report(record: TransferRecord) -> None:
    """Hand ``record`` to every listener (called by the handlers)."""
    for listener in _listeners:
        try:
            listener(record)
        except Exception:
            logger.warning("transfer listener %r raised", listener, exc_info=True)
