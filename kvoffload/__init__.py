"""kvoffload: KV-cache offloading (vLLM 0.11.2 ``kv_offload`` compatible).

``import kvoffload`` loads neither torch nor any web, metrics or tracing
stack; torch-bound names (``CpuGpuOffloadingHandler``) load on first access.
"""

from typing import TYPE_CHECKING, Any

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
from kvoffload.errors import (
    BlockStateError,
    ConfigError,
    KVOffloadError,
    PolicyContractError,
    PolicyError,
    PolicyFailedError,
    TransferError,
    UnknownTicketError,
)
from kvoffload.event_log import EventLog, EventPage, EventRecord
from kvoffload.factory import OffloadingSpecFactory
from kvoffload.manager import (
    ARCOffloadingManager,
    LRUOffloadingManager,
    PolicyOffloadingManager,
)
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.policies import EvictionPolicy, available_policies
from kvoffload.spec import CPUOffloadingSpec, OffloadingConfig, OffloadingSpec
from kvoffload.stats import ManagerCounters, ManagerStats, WindowStats
from kvoffload.transfer.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)

if TYPE_CHECKING:
    from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler  # noqa: F401

# CpuGpuOffloadingHandler is reachable as an attribute but left out of __all__
# so that ``from kvoffload import *`` does not load torch.
__all__ = [
    "ARCOffloadingManager",
    "Backend",
    "BlockHash",
    "BlockStateError",
    "BlockStatus",
    "CPUBackend",
    "CPULoadStoreSpec",
    "CPUOffloadingSpec",
    "ConfigError",
    "EventLog",
    "EventPage",
    "EventRecord",
    "EvictionPolicy",
    "GPULoadStoreSpec",
    "KVOffloadError",
    "LRUOffloadingManager",
    "LoadStoreSpec",
    "ManagerCounters",
    "ManagerStats",
    "OffloadingConfig",
    "OffloadingEvent",
    "OffloadingHandler",
    "OffloadingManager",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "OffloadingWorker",
    "PolicyContractError",
    "PolicyError",
    "PolicyFailedError",
    "PolicyOffloadingManager",
    "PrepareStoreOutput",
    "TransferError",
    "TransferResult",
    "TransferSpec",
    "UnknownTicketError",
    "WindowStats",
    "__version__",
    "available_policies",
]


def __getattr__(name: str) -> Any:
    if name == "CpuGpuOffloadingHandler":
        from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

        return CpuGpuOffloadingHandler
    raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
