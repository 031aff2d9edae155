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
        },
    )

Importing this package does not import vLLM (or torch): ``KVOffloadSpec``
does, on first access. See docs/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload.vllm.config import EXTRA_CONFIG_KEYS, admin_port, offloading_config
from kvoffload.vllm.handler import ReportingHandler
from kvoffload.vllm.live import (
    add_transfer_listener,
    live_admin_servers,
    live_handlers,
    live_managers,
)

if TYPE_CHECKING:
    from kvoffload.vllm.spec import KVOffloadSpec

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "KVOffloadSpec",
    "ReportingHandler",
    "add_transfer_listener",
    "admin_port",
    "live_admin_servers",
    "live_handlers",
    "live_managers",
    "offloading_config",
]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadSpec":
        try:
            from kvoffload.vllm.spec import KVOffloadSpec
        except ImportError as exc:
            raise ImportError(
                f"kvoffload.vllm.KVOffloadSpec needs vLLM 0.11.2 installed ({exc})"
            ) from exc
        return KVOffloadSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
