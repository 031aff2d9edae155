"""The serving process: the engine loop that drives a manager and a transfer
handler, and the workloads (trace replay, built-in synthetic) that feed it.

Importing this package loads torch (the engine's KV tensors); ``import
kvoffload`` alone does not.
"""

from kvoffload.runtime.commands import (
    Command,
    CommandResult,
    EngineStoppedError,
    VersionConflictError,
)
from kvoffload.runtime.engine import Engine, EngineConfig
from kvoffload.runtime.observer import EngineObserver, RequestRecord, TransferRecord
from kvoffload.runtime.snapshot import EngineSnapshot, RuntimeStats

__all__ = [
    "Command",
    "CommandResult",
    "Engine",
    "EngineConfig",
    "EngineObserver",
    "EngineSnapshot",
    "EngineStoppedError",
    "RequestRecord",
    "RuntimeStats",
    "TransferRecord",
    "VersionConflictError",
]
