"""Offloading specs: what to build for a configuration (vLLM ``kv_offload.spec`` / ``cpu``).

A spec is made either from a small typed :class:`OffloadingConfig` or, as in
vLLM, from an engine config object read by duck typing
(``kv_transfer_config.kv_connector_extra_config``, ``cache_config.block_size``,
``kv_events_config.enable_kv_cache_events``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload._checks import is_int
from kvoffload.abstract import LoadStoreSpec, OffloadingManager
from kvoffload.backends.cpu import CPUBackend
from kvoffload.errors import ConfigError
from kvoffload.event_log import DEFAULT_CAPACITY
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.policies import available_policies, policy_class
from kvoffload.transfer.worker import OffloadingHandler

if TYPE_CHECKING:
    import torch

    from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

logger = logging.getLogger(__name__)

DEFAULT_SPEC_NAME = "CPUOffloadingSpec"


#: the longest digit string a count is read from (a JSON config may hold
#: strings; int() of thousands of digits is Python's own error)
_MAX_DIGITS = 18


def _positive_int(name: str, value: object) -> int:
    """An int > 0, or the ASCII digits of one (a JSON extra config's
    ``"64"``; not ``"٦٤"``, which ``int()`` would take too)."""
    if isinstance(value, str):
        text = value.strip().removeprefix("+")
        # leading zeros do not count against the length ("0064" is 64)
        if text.isascii() and text.isdigit() and len(text.lstrip("0")) <= _MAX_DIGITS:
            value = int(text)
    if not is_int(value) or value <= 0:
        shown = (
            repr(value)
            if not isinstance(value, str) or len(value) <= 40
            else (f"a string of {len(value)} characters")
        )
        raise ConfigError(f"{name} must be a positive integer, got {shown}")
    return value


def _typed_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class OffloadingConfig:
    """Typed offloading configuration.

    ``offloaded_block_size`` (tokens per CPU block) defaults to
    ``gpu_block_size`` and must be a multiple of it.
    """

    gpu_block_size: int
    num_cpu_blocks: int
    offloaded_block_size: int | None = None
    eviction_policy: str = "lru"
    enable_events: bool = False
    event_log_capacity: int = DEFAULT_CAPACITY
    spec_name: str = DEFAULT_SPEC_NAME
    spec_module_path: str | None = None

    def __post_init__(self) -> None:
        # typed: an int is an int here ("16" validated once, then broke the
        # block-size check and get_manager); from_vllm_config converts the
        # strings a JSON extra config may hold
        for name in ("gpu_block_size", "num_cpu_blocks", "event_log_capacity"):
            _typed_positive_int(name, getattr(self, name))
        if self.offloaded_block_size is not None:
            _typed_positive_int("offloaded_block_size", self.offloaded_block_size)
        if not isinstance(self.enable_events, bool):
            raise ConfigError(f"enable_events must be True or False, got {self.enable_events!r}")
        obs = self.block_size
        if obs % self.gpu_block_size:
            raise ConfigError(
                f"offloaded block size {obs} must be a multiple of the GPU block size "
                f"{self.gpu_block_size} (e.g. {self.gpu_block_size * max(1, obs // self.gpu_block_size)})"
            )
        policy_class(self.eviction_policy)  # raises PolicyError naming the valid ones

    @property
    def block_size(self) -> int:
        """Tokens per offloaded (CPU) block."""
        return (
            self.offloaded_block_size
            if self.offloaded_block_size is not None
            else self.gpu_block_size
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> OffloadingConfig:
        """Read a vLLM-style config object (duck-typed)."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        if ktc is None:
            raise ConfigError("vllm_config.kv_transfer_config is required for KV offloading")
        extra: Mapping[str, Any] = getattr(ktc, "kv_connector_extra_config", None) or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config must be a dict, got {type(extra).__name__}"
            )
        cache_config = getattr(vllm_config, "cache_config", None)
        gpu_block_size = getattr(cache_config, "block_size", None)
        if gpu_block_size is None:
            raise ConfigError("vllm_config.cache_config.block_size is required")
        if not extra.get("num_cpu_blocks"):
            raise ConfigError(
                "num_cpu_blocks must be set to a positive integer in kv_connector_extra_config"
            )
        events_cfg = getattr(vllm_config, "kv_events_config", None)
        enable_events = getattr(events_cfg, "enable_kv_cache_events", False)
        if not isinstance(enable_events, bool):  # "false" is truthy: it turned events on
            raise ConfigError(
                "kv_events_config.enable_kv_cache_events must be True or False, "
                f"got {enable_events!r}"
            )
        names = {
            "eviction_policy": extra.get("eviction_policy", "lru"),
            "spec_name": extra.get("spec_name", DEFAULT_SPEC_NAME),
            "spec_module_path": extra.get("spec_module_path", ""),
        }
        for key, value in names.items():
            if not isinstance(value, str):
                raise ConfigError(f"{key} must be a string, got {value!r}")
        return cls(
            gpu_block_size=_positive_int("cache_config.block_size", gpu_block_size),
            num_cpu_blocks=_positive_int("num_cpu_blocks", extra["num_cpu_blocks"]),
            offloaded_block_size=_positive_int(
                "block_size", extra.get("block_size", gpu_block_size)
            ),
            eviction_policy=names["eviction_policy"],
            enable_events=enable_events,
            spec_name=names["spec_name"],
            spec_module_path=names["spec_module_path"] or None,
        )


def _to_config(config: OffloadingConfig | Any) -> OffloadingConfig:
    return (
        config
        if isinstance(config, OffloadingConfig)
        else OffloadingConfig.from_vllm_config(config)
    )


class OffloadingSpec(ABC):
    """Builds the scheduler-side manager and the worker-side handlers."""

    def __init__(self, vllm_config: OffloadingConfig | Any) -> None:
        self.vllm_config = vllm_config
        self.config = _to_config(vllm_config)
        self.gpu_block_size = self.config.gpu_block_size
        self.offloaded_block_size = self.config.block_size

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The (single) scheduler-side manager."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor], attn_backends: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """``(src spec class, dst spec class, handler)`` for every direction."""


class CPUOffloadingSpec(OffloadingSpec):
    """Offload to CPU memory: a :class:`CPUBackend` manager and a
    :class:`~kvoffload.transfer.CpuGpuOffloadingHandler` for both directions."""

    #: the keys of ``kv_connector_extra_config`` this spec reads (vLLM's);
    #: others are refused, so a subclass that reads keys of its own adds them
    EXTRA_CONFIG_KEYS = (
        "spec_name",
        "spec_module_path",
        "num_cpu_blocks",
        "block_size",
        "eviction_policy",
    )

    def __init__(self, vllm_config: OffloadingConfig | Any) -> None:
        """:class:`ConfigError` for a key of a vLLM config's extra config it
        does not read (a misspelt ``evicton_policy`` ran LRU, and
        ``policy_modules`` was ignored)."""
        super().__init__(vllm_config)
        if not isinstance(vllm_config, OffloadingConfig):
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            unknown = sorted(set(extra) - set(self.EXTRA_CONFIG_KEYS), key=str)
            if unknown:
                raise ConfigError(
                    f"kv_connector_extra_config for {type(self).__name__}: unknown key "
                    f"{unknown[0]!r} (valid keys: {', '.join(self.EXTRA_CONFIG_KEYS)}; "
                    "policy_modules, admin_port, lookahead, row_kernel and event_log_capacity "
                    "are keys of kvoffload.vllm.KVOffloadSpec)"
                )
        self.num_cpu_blocks = self.config.num_cpu_blocks
        self.eviction_policy = self.config.eviction_policy
        self._manager: PolicyOffloadingManager | None = None
        self._handler: CpuGpuOffloadingHandler | None = None

    def get_manager(self) -> PolicyOffloadingManager:
        if self._manager is None:
            backend = CPUBackend(
                block_size=self.offloaded_block_size, num_blocks=self.num_cpu_blocks
            )
            self._manager = PolicyOffloadingManager(
                backend,
                policy=self.eviction_policy,
                enable_events=self.config.enable_events,
                event_log_capacity=self.config.event_log_capacity,
            )
        return self._manager

    def get_handler(
        self,
        kv_caches: dict[str, torch.Tensor],
        attn_backends: Mapping[str, Any] | None = None,
        *,
        row_kernel: bool | None = None,
    ) -> CpuGpuOffloadingHandler:
        """The one handler of both directions, built on the first call
        (``row_kernel``: its CUDA copy path for scattered blocks, see
        :class:`~kvoffload.transfer.CpuGpuOffloadingHandler`)."""
        if self._handler is None:
            from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

            self._handler = CpuGpuOffloadingHandler(
                gpu_caches=kv_caches,
                gpu_block_size=self.gpu_block_size,
                cpu_block_size=self.offloaded_block_size,
                num_cpu_blocks=self.num_cpu_blocks,
                attn_backends=attn_backends,
                row_kernel=row_kernel,
            )
        return self._handler

    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor], attn_backends: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        handler = self.get_handler(kv_caches, attn_backends)
        yield GPULoadStoreSpec, CPULoadStoreSpec, handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, handler


__all__ = [
    "CPUOffloadingSpec",
    "OffloadingConfig",
    "OffloadingSpec",
    "available_policies",
]
