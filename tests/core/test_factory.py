"""The spec factory: lazy registration and specs loaded by module path."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from kvoffload import (
    ConfigError,
    CPUBackend,
    CPUOffloadingSpec,
    LoadStoreSpec,
    OffloadingConfig,
    OffloadingHandler,
    OffloadingSpec,
    OffloadingSpecFactory,
    PolicyOffloadingManager,
)

from .test_spec import vllm_config

LAZY_MODULE = __name__.rpartition(".")[0] + ".lazy_spec_module"


class TinySpec(OffloadingSpec):
    """A spec defined outside kvoffload, found through ``spec_module_path``."""

    def get_manager(self) -> PolicyOffloadingManager:
        return PolicyOffloadingManager(CPUBackend(self.offloaded_block_size, 3), policy="arc")

    def get_handlers(
        self, kv_caches: dict[str, Any], attn_backends: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        return iter(())


class NotASpec:
    def __init__(self, config: object) -> None:
        self.config = config


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A private copy of the factory registry for each test."""
    copy = dict(OffloadingSpecFactory._registry)
    monkeypatch.setattr(OffloadingSpecFactory, "_registry", copy)
    return copy


def test_factory_creates_the_default_cpu_spec() -> None:
    assert "CPUOffloadingSpec" in OffloadingSpecFactory.registered_specs()
    spec = OffloadingSpecFactory.create_spec(vllm_config({"num_cpu_blocks": 8}))
    assert isinstance(spec, CPUOffloadingSpec)
    assert spec.get_manager().stats().capacity == 8


def test_factory_registration_imports_nothing_until_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, LAZY_MODULE, raising=False)
    OffloadingSpecFactory.register_spec("LazySpec", LAZY_MODULE, "LazySpec")
    assert LAZY_MODULE not in sys.modules
    assert "LazySpec" in OffloadingSpecFactory.registered_specs()
    spec = OffloadingSpecFactory.create_spec(OffloadingConfig(16, 4, spec_name="LazySpec"))
    assert LAZY_MODULE in sys.modules
    assert type(spec).__name__ == "LazySpec"
    manager = spec.get_manager()
    assert isinstance(manager, PolicyOffloadingManager)
    assert manager.stats().capacity == 2


def test_factory_refuses_duplicate_registration() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "kvoffload.spec", "X")


def test_factory_loads_unregistered_spec_from_module_path() -> None:
    spec = OffloadingSpecFactory.create_spec(
        vllm_config({"num_cpu_blocks": 8, "spec_name": "TinySpec", "spec_module_path": __name__})
    )
    assert isinstance(spec, TinySpec)
    assert spec.get_manager().policy_name == "arc"
    assert "TinySpec" not in OffloadingSpecFactory.registered_specs()


def test_factory_unknown_spec_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        OffloadingSpecFactory.create_spec(OffloadingConfig(16, 4, spec_name="NoSuchSpec"))
    message = str(exc.value)
    assert "'NoSuchSpec'" in message
    for name in OffloadingSpecFactory.registered_specs():
        assert name in message
    assert "spec_module_path" in message


@pytest.mark.parametrize(
    ("name", "module", "message"),
    [
        ("TinySpec", "no_such_module_for_kvoffload_tests", "cannot import spec_module_path"),
        ("Missing", __name__, "has no spec named 'Missing'"),
        ("NotASpec", __name__, "not an OffloadingSpec subclass"),
    ],
    ids=["bad-module", "missing-class", "not-a-spec"],
)
def test_factory_module_path_errors(name: str, module: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadingSpecFactory.create_spec(
            OffloadingConfig(16, 4, spec_name=name, spec_module_path=module)
        )
