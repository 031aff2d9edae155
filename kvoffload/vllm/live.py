"""What :class:`~kvoffload.vllm.KVOffloadSpec` built in this process.

vLLM creates one spec for the scheduler side (it asks for the manager) and
one for each worker (they ask for the handlers); with vLLM's in-process
executor both live in the engine-core process. This registry is how the two
sides, and a test or an embedding host, find each other there: the managers
vLLM drives, the handlers its workers copy with, and the listeners every
finished transfer job is reported to (as a
:class:`~kvoffload.runtime.observer.TransferRecord`). A worker in another
process has its own registry: listeners added here never hear of its jobs.

Managers and handlers are held weakly, so an engine that is gone leaves
nothing behind.
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
    from kvoffload.vllm.handler import ReportingHandler

logger = logging.getLogger(__name__)

TransferListener = Callable[[TransferRecord], None]
_T = TypeVar("_T")

_lock = threading.Lock()
_managers: list[weakref.ref[PolicyOffloadingManager]] = []
_handlers: list[weakref.ref[ReportingHandler]] = []
_listeners: tuple[TransferListener, ...] = ()


def _alive(refs: list[weakref.ref[_T]]) -> list[_T]:
    refs[:] = [ref for ref in refs if ref() is not None]
    return [obj for ref in refs if (obj := ref()) is not None]


def add_manager(manager: PolicyOffloadingManager) -> None:
    with _lock:
        _managers.append(weakref.ref(manager))


def add_handler(handler: ReportingHandler) -> None:
    with _lock:
        _handlers.append(weakref.ref(handler))


def live_managers() -> list[PolicyOffloadingManager]:
    """Scheduler-side managers of the engines alive in this process, oldest first."""
    with _lock:
        return _alive(_managers)


def live_handlers() -> list[ReportingHandler]:
    """Worker-side handlers alive in this process, oldest first."""
    with _lock:
        return _alive(_handlers)


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
