"""kvoffload inside a real vLLM 0.11.2 engine.

vLLM's ``OffloadingConnector`` loads :class:`KVOffloadSpec` from here with::

    KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.vllm",
            "num_cpu_blocks": 4096,
            "block_size": 64,            # optional, a multiple of vLLM's
            "eviction_policy": "kvarc",  # optional, default "lru"
            "admin_port": 8001,          # optional: kvoffload's admin API
            "lookahead": 64,             # optional: for HintingScheduler
            "row_kernel": None,          # optional: CUDA copy path (docs/transfer.md)
        },
    )

and ``scheduler_cls="kvoffload.vllm.HintingScheduler"`` makes vLLM's
scheduler hint its waiting queue to the manager (for ``hkvarc``).

Importing this package does not import vLLM (or torch): ``KVOffloadSpec``
and ``HintingScheduler`` do, on first access. See docs/vllm.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.vllm.config import (
    EXTRA_CONFIG_KEYS,
    admin_port,
    lookahead,
    offloading_config,
    row_kernel,
)
from kvoffload.vllm.handler import ReportingHandler
from kvoffload.vllm.live import (
    add_transfer_listener,
    live_admin_servers,
    live_handlers,
    live_managers,
)

if TYPE_CHECKING:
    from kvoffload.vllm.scheduler import HintingScheduler
    from kvoffload.vllm.spec import KVOffloadSpec

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "HintingScheduler",
    "KVOffloadSpec",
    "ReportingHandler",
    "add_transfer_listener",
    "admin_port",
    "live_admin_servers",
    "live_handlers",
    "live_managers",
    "lookahead",
    "offloading_config",
    "row_kernel",
]


_NEED_VLLM = {"KVOffloadSpec": "spec", "HintingScheduler": "scheduler"}


def __getattr__(name: str) -> Any:
    if name in _NEED_VLLM:
        module = f"kvoffload.vllm.{_NEED_VLLM[name]}"
        try:
            value = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            raise ImportError(f"kvoffload.vllm.{name} needs vLLM 0.11.2 installed ({exc})") from exc
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
