"""Spec registry (vLLM ``kv_offload.factory``): names resolve lazily to classes."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from kvoffload.errors import ConfigError
from kvoffload.spec import OffloadingConfig, OffloadingSpec, _to_config

__all__ = ["OffloadingSpecFactory"]

logger = logging.getLogger(__name__)


class OffloadingSpecFactory:
    """Creates the :class:`OffloadingSpec` a configuration names."""

    _registry: ClassVar[dict[str, Callable[[], type[OffloadingSpec]]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name``; imported on first use."""
        if name in cls._registry:
            raise ConfigError(f"offloading spec {name!r} is already registered")

        def loader() -> type[OffloadingSpec]:
            module = importlib.import_module(module_path)
            spec_cls: type[OffloadingSpec] = getattr(module, class_name)
            return spec_cls

        cls._registry[name] = loader

    @classmethod
    def registered_specs(cls) -> tuple[str, ...]:
        return tuple(sorted(cls._registry))

    @classmethod
    def create_spec(cls, config: OffloadingConfig | Any) -> OffloadingSpec:
        """Build the spec named by ``spec_name`` (default ``CPUOffloadingSpec``);
        an unregistered name is imported from ``spec_module_path``."""
        cfg = _to_config(config)
        name = cfg.spec_name
        if name in cls._registry:
            spec_cls = cls._registry[name]()
        else:
            if not cfg.spec_module_path:
                raise ConfigError(
                    f"unknown offloading spec {name!r}: registered specs are "
                    f"{', '.join(cls.registered_specs())}; or set spec_module_path to the "
                    "module that defines it"
                )
            try:
                module = importlib.import_module(cfg.spec_module_path)
            except ImportError as e:
                raise ConfigError(
                    f"cannot import spec_module_path {cfg.spec_module_path!r}: {e}"
                ) from e
            try:
                spec_cls = getattr(module, name, None)  # type: ignore[assignment]
            except ImportError as e:  # a lazy attribute: kvoffload.vllm's needs vLLM
                raise ConfigError(
                    f"spec {name!r} of {cfg.spec_module_path!r} cannot be imported: {e}"
                ) from e
            if spec_cls is None:
                raise ConfigError(f"module {cfg.spec_module_path!r} has no spec named {name!r}")
        if not (isinstance(spec_cls, type) and issubclass(spec_cls, OffloadingSpec)):
            raise ConfigError(f"{name!r} is not an OffloadingSpec subclass")
        logger.info("creating offloading spec %s", name)
        return spec_cls(config)


OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "kvoffload.spec", "CPUOffloadingSpec")
