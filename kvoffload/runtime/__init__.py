"""The serving process: the engine loop that drives a manager and a transfer
handler, the workloads (trace replay, built-in synthetic) that feed it, and
:class:`HostedManager` for a manager that a host's scheduler drives instead.

The engine needs torch; it is imported lazily so that the workload modules
(and ``kvoffload replay``) load without it.
"""

from typing import TYPE_CHECKING, Any

from kvoffload.runtime.commands import (
    Command,
    CommandResult,
    EngineStoppedError,
    UnsupportedCommandError,
    VersionConflictError,
)
from kvoffload.runtime.hosted import HostedConfig, HostedManager
from kvoffload.runtime.observer import EngineObserver, RequestRecord, TransferRecord
from kvoffload.runtime.snapshot import EngineSnapshot, RuntimeStats

if TYPE_CHECKING:
    from kvoffload.runtime.config import EngineConfig
    from kvoffload.runtime.engine import Engine

__all__ = [
    "Command",
    "CommandResult",
    "Engine",
    "EngineConfig",
    "EngineObserver",
    "EngineSnapshot",
    "EngineStoppedError",
    "HostedConfig",
    "HostedManager",
    "RequestRecord",
    "RuntimeStats",
    "TransferRecord",
    "UnsupportedCommandError",
    "VersionConflictError",
]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from kvoffload.runtime.engine import Engine

        return Engine
    if name == "EngineConfig":
        from kvoffload.runtime.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
