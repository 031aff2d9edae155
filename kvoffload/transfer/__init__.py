"""Moving block data between mediums.

The worker and the in-memory handler are plain Python; only
:mod:`kvoffload.transfer.cpu_gpu` imports torch, and it is loaded lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload.transfer.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)

if TYPE_CHECKING:
    from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

__all__ = [
    "CpuGpuOffloadingHandler",
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
]


def __getattr__(name: str) -> Any:
    if name == "CpuGpuOffloadingHandler":
        from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

        return CpuGpuOffloadingHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
