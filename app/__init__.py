"""The kvoffload admin service: a FastAPI application around a running engine
or a manager a host process drives.

- ``kvoffload serve`` (:func:`app.main.run`) runs the engine and the admin
  API in one process;
- :func:`start_admin_server` embeds the admin API in any host process, for an
  :class:`~kvoffload.runtime.Engine` or a :class:`~kvoffload.runtime.HostedManager`;
- :func:`app.main.create_app` builds the application for tests and
  ``uvicorn --factory``.

Nothing is created at import time, and importing this package loads no web
stack: the names below load it when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.embedded import AdminServer, StartupError, start_admin_server

__all__ = ["AdminServer", "StartupError", "start_admin_server"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from app import embedded

        return getattr(embedded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
