"""kvoffload: KV-cache offloading (vLLM 0.11.2 ``kv_offload`` compatible)."""

from kvoffload._version import __version__
from kvoffload.abstract import (
    BlockHash,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvoffload.backend import Backend, BlockStatus
from kvoffload.backends.cpu import CPUBackend
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)

__all__ = [
    "Backend",
    "BlockHash",
    "BlockStatus",
    "CPUBackend",
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "OffloadingEvent",
    "OffloadingHandler",
    "OffloadingManager",
    "OffloadingWorker",
    "PrepareStoreOutput",
    "TransferResult",
    "TransferSpec",
    "__version__",
]
