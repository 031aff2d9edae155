"""vLLM's ``OffloadingSpec`` around kvoffload's manager and handler.

This module imports vLLM (0.11.2); vLLM loads it through
``kvoffload.vllm.KVOffloadSpec`` when its ``OffloadingConnector`` is
configured with ``spec_module_path="kvoffload.vllm"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_offload.spec import OffloadingSpec

from kvoffload.abstract import LoadStoreSpec
from kvoffload.errors import ConfigError
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.spec import CPUOffloadingSpec
from kvoffload.vllm import live
from kvoffload.vllm.config import admin_port, offloading_config, row_kernel
from kvoffload.vllm.handler import ReportingHandler

if TYPE_CHECKING:
    import torch

    from kvoffload.vllm.admin import VLLMHostedManager

__all__ = ["KVOffloadSpec"]


def _attention_backends(vllm_config: Any, layer_names: list[str]) -> dict[str, Any]:
    """Each KV cache layer's attention backend, as vLLM's own ``cpu.py``
    finds it: the layer objects of the model, asked for their backend."""
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    missing = [name for name in layer_names if name not in layers]
    if missing:
        raise ConfigError(
            f"KV cache layers {missing} are not attention layers of the model, so their "
            "KV layout is unknown"
        )
    return {name: layers[name].get_attn_backend() for name in layer_names}


def _release_worker_connector() -> None:
    """Release the worker connector vLLM 0.11.2 keeps in a process global, as
    ``EngineCore.shutdown()`` does: an engine whose start fails never gets
    there, and the next engine in the process would get this one's."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


class KVOffloadSpec(OffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    """Offload vLLM's KV cache to kvoffload's CPU tier.

    The scheduler side gets a
    :class:`~kvoffload.manager.PolicyOffloadingManager` (any registered
    policy, vLLM's defects fixed), the worker side one
    :class:`~kvoffload.vllm.handler.ReportingHandler` over
    :class:`~kvoffload.transfer.CpuGpuOffloadingHandler` for both
    directions: CUDA streams when vLLM's KV cache is on CUDA, synchronous
    copies when it is in CPU memory (vLLM's CPU platform). Both register in
    :mod:`kvoffload.vllm.live`. With ``admin_port`` the manager is served by
    kvoffload's admin server (:mod:`kvoffload.vllm.admin`).

    Raises :class:`~kvoffload.errors.ConfigError` on a bad extra config
    (see :func:`~kvoffload.vllm.config.offloading_config`).
    """

    def __init__(self, vllm_config: Any) -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConfigError("KVOffloadSpec needs vllm_config.kv_transfer_config")
        events = vllm_config.kv_events_config
        extra = ktc.kv_connector_extra_config or {}
        #: whether vLLM asked for KV events (its connector then publishes ours)
        self.vllm_events = bool(events is not None and events.enable_kv_cache_events)
        #: kvoffload's typed view of the extra config, checked before vLLM's
        #: base class asserts on it
        self.offloading_config = offloading_config(
            extra, vllm_config.cache_config.block_size, enable_events=self.vllm_events
        )
        self.admin_port = admin_port(extra)
        self.row_kernel = row_kernel(extra)
        super().__init__(vllm_config)
        self.kvoffload_spec = CPUOffloadingSpec(self.offloading_config)
        self._manager: PolicyOffloadingManager | VLLMHostedManager | None = None
        self._handler: ReportingHandler | None = None

    def get_manager(self) -> PolicyOffloadingManager | VLLMHostedManager:
        """The scheduler side's manager, built once; with ``admin_port``
        wrapped and served by the admin server, which must start (else a
        :class:`~kvoffload.errors.ConfigError` names the port)."""
        if self._manager is None:
            manager: PolicyOffloadingManager | VLLMHostedManager
            manager = self.kvoffload_spec.get_manager()
            if self.admin_port is not None:
                # the web stack, only for an engine that asks for it
                from kvoffload.vllm.admin import serve_admin

                try:
                    manager = serve_admin(
                        manager,
                        self.admin_port,
                        vllm_events=self.vllm_events,
                        workers=live.live_handlers(self.vllm_config),
                        event_log_capacity=self.offloading_config.event_log_capacity,
                    )
                except ConfigError:
                    _release_worker_connector()
                    raise
            live.add_manager(manager)
            self._manager = manager
        return self._manager

    def get_handlers(
        self, kv_caches: dict[str, torch.Tensor]
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], ReportingHandler]]:
        """One handler for GPU->CPU and CPU->GPU, its layout learnt from the
        attention backends (vLLM's CPU cache is ``(2, num_blocks, ...)``,
        which a shape alone cannot tell from blocks-first). vLLM asks once per
        engine; a second call is another engine's worker given this one's
        connector (:class:`~kvoffload.errors.ConfigError`)."""
        if self._handler is not None:
            # vLLM 0.11.2 keeps one worker connector per process: a second
            # engine's workers in this process got the first's (whose handler
            # vLLM would register twice, failing on a bare assert)
            raise ConfigError(
                "vLLM 0.11.2 keeps one KV connector per process, and this engine's worker "
                "got the one of an engine still alive in this process (its engine core in "
                "the calling process: VLLM_ENABLE_V1_MULTIPROCESSING=0): shut that engine "
                "down first (llm.llm_engine.engine_core.shutdown()), or let vLLM run each "
                "engine core in a process of its own (its default)"
            )
        backends = _attention_backends(self.vllm_config, list(kv_caches))
        inner = self.kvoffload_spec.get_handler(kv_caches, backends, row_kernel=self.row_kernel)
        self._handler = ReportingHandler(inner)
        live.add_handler(self._handler, self.vllm_config)
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handler
