"""A spec module that only the lazy-registration test imports (through the factory)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvoffload import CPUBackend, LoadStoreSpec, OffloadingHandler, PolicyOffloadingManager
from kvoffload.spec import OffloadingSpec


class LazySpec(OffloadingSpec):
    def get_manager(self) -> PolicyOffloadingManager:
        return PolicyOffloadingManager(CPUBackend(self.offloaded_block_size, 2))

    def get_handlers(
        self, kv_caches: dict[str, Any], attn_backends: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        return iter(())
