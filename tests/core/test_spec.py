"""Offloading configuration and the CPU spec."""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvoffload import (
    ConfigError,
    CPUOffloadingSpec,
    OffloadingConfig,
    OffloadingSpecFactory,
    PolicyError,
    PolicyOffloadingManager,
)
from kvoffload.policies import available_policies


def vllm_config(
    extra: dict[str, Any] | None = None, block_size: int = 16, events: bool | None = None
) -> SimpleNamespace:
    """A duck-typed stand-in for vLLM's ``VllmConfig``."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=block_size),
        kv_events_config=None if events is None else SimpleNamespace(enable_kv_cache_events=events),
    )


def test_offloading_config_defaults() -> None:
    cfg = OffloadingConfig(gpu_block_size=16, num_cpu_blocks=64)
    assert cfg.block_size == 16
    assert cfg.eviction_policy == "lru"
    assert cfg.enable_events is False
    assert cfg.spec_name == "CPUOffloadingSpec"
    assert OffloadingConfig(16, 64, offloaded_block_size=64).block_size == 64


@pytest.mark.parametrize("num_cpu_blocks", [0, -4, 2.0, "many", True])
def test_offloading_config_rejects_non_positive_cpu_blocks(num_cpu_blocks: Any) -> None:
    with pytest.raises(ConfigError, match="num_cpu_blocks must be a positive integer"):
        OffloadingConfig(gpu_block_size=16, num_cpu_blocks=num_cpu_blocks)


def test_offloading_config_rejects_block_size_not_a_multiple() -> None:
    with pytest.raises(ConfigError, match="must be a multiple of the GPU block size 16"):
        OffloadingConfig(gpu_block_size=16, num_cpu_blocks=8, offloaded_block_size=24)


def test_offloading_config_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(PolicyError) as exc:
        OffloadingConfig(gpu_block_size=16, num_cpu_blocks=8, eviction_policy="fifo")
    message = str(exc.value)
    assert "'fifo'" in message
    for name in available_policies():
        assert name in message
    assert isinstance(exc.value, ConfigError)


@pytest.mark.parametrize("policy", available_policies())
def test_offloading_config_selects_every_policy_in_any_case(policy: str) -> None:
    spec = CPUOffloadingSpec(OffloadingConfig(16, 8, eviction_policy=policy.upper()))
    assert spec.get_manager().policy_name == policy


def test_offloading_config_from_vllm_style_config() -> None:
    cfg = OffloadingConfig.from_vllm_config(
        vllm_config(
            {"num_cpu_blocks": 128, "block_size": 64, "eviction_policy": "arc"},
            block_size=16,
            events=True,
        )
    )
    assert (cfg.gpu_block_size, cfg.num_cpu_blocks, cfg.block_size) == (16, 128, 64)
    assert cfg.eviction_policy == "arc"
    assert cfg.enable_events is True


@pytest.mark.parametrize("events", [None, False])
def test_offloading_config_from_vllm_style_config_events_off(events: bool | None) -> None:
    cfg = OffloadingConfig.from_vllm_config(vllm_config({"num_cpu_blocks": 8}, events=events))
    assert cfg.enable_events is False
    assert cfg.block_size == 16


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (vllm_config({}), "num_cpu_blocks must be set"),
        (vllm_config(None), "num_cpu_blocks must be set"),
        (vllm_config({"num_cpu_blocks": 0}), "num_cpu_blocks must be set"),
        (vllm_config({"num_cpu_blocks": -3}), "num_cpu_blocks must be a positive integer"),
        (vllm_config({"num_cpu_blocks": 8, "block_size": 20}), "multiple"),
        (SimpleNamespace(cache_config=SimpleNamespace(block_size=16)), "kv_transfer_config"),
        (
            SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={})),
            "cache_config.block_size",
        ),
    ],
    ids=[
        "missing",
        "no-extra",
        "zero",
        "negative",
        "not-multiple",
        "no-kv-transfer",
        "no-cache-config",
    ],
)
def test_offloading_config_from_vllm_style_config_errors(config: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadingConfig.from_vllm_config(config)


@pytest.mark.parametrize("text", ["64", " 64", "+64", "0064", "0" * 30 + "64"])
def test_a_vllm_style_config_reads_counts_from_ascii_digits(text: str) -> None:
    # as vLLM's int() reads them (docs/library.md)
    config = OffloadingConfig.from_vllm_config(
        vllm_config({"num_cpu_blocks": text, "block_size": "32"})
    )
    assert (config.num_cpu_blocks, config.block_size) == (64, 32)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # each was taken: a string of digits not ASCII, one too long for int()
        # (a traceback), a truthy "false" (events on), None read as 'None', an
        # int path (AttributeError), a list for the dict (AttributeError)
        (vllm_config({"num_cpu_blocks": "٦٤"}), r"num_cpu_blocks must be a positive integer"),
        (vllm_config({"num_cpu_blocks": "9" * 5000}), r"got a string of 5000 characters"),
        (vllm_config({"num_cpu_blocks": 8}, events="false"), r"enable_kv_cache_events must be"),  # type: ignore[arg-type]
        (
            vllm_config({"num_cpu_blocks": 8, "eviction_policy": None}),
            r"eviction_policy must be a string, got None",
        ),
        (
            vllm_config({"num_cpu_blocks": 8, "spec_module_path": 3}),
            r"spec_module_path must be a string, got 3",
        ),
        (vllm_config(["num_cpu_blocks"]), r"kv_connector_extra_config must be a dict, got list"),  # type: ignore[arg-type]
    ],
    ids=["unicode-digits", "5000-digits", "events-str", "policy-none", "path-int", "extra-list"],
)
def test_a_vllm_style_config_takes_its_types_only(config: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadingConfig.from_vllm_config(config)


@pytest.mark.parametrize(
    ("key", "hint"),
    [("evicton_policy", "valid keys: spec_name"), ("policy_modules", "KVOffloadSpec")],
)
def test_cpu_offloading_spec_refuses_a_key_it_does_not_read(key: str, hint: str) -> None:
    # a misspelt key silently ran LRU; policy_modules (KVOffloadSpec's) was ignored
    with pytest.raises(ConfigError, match=rf"unknown key '{key}' \(.*{hint}"):
        CPUOffloadingSpec(vllm_config({"num_cpu_blocks": 8, key: "arc"}))


def test_a_spec_that_needs_vllm_is_a_config_error_without_it() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    extra = {
        "num_cpu_blocks": 8,
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload.vllm",
    }
    with pytest.raises(
        ConfigError, match=r"spec 'KVOffloadSpec' of 'kvoffload.vllm' cannot be imported"
    ):
        OffloadingSpecFactory.create_spec(vllm_config(extra))


def test_cpu_offloading_spec_builds_one_manager() -> None:
    spec = CPUOffloadingSpec(
        vllm_config(
            {"num_cpu_blocks": 32, "block_size": 32, "eviction_policy": "arc"},
            block_size=16,
            events=True,
        )
    )
    assert (spec.gpu_block_size, spec.offloaded_block_size) == (16, 32)
    assert (spec.num_cpu_blocks, spec.eviction_policy) == (32, "arc")
    m = spec.get_manager()
    assert isinstance(m, PolicyOffloadingManager)
    assert m is spec.get_manager()
    s = m.stats()
    assert (s.capacity, s.block_size, s.policy, s.medium) == (32, 32, "arc", "CPU")
    assert m.event_log is not None


def test_cpu_offloading_spec_accepts_a_typed_config() -> None:
    cfg = OffloadingConfig(16, 4, enable_events=False, event_log_capacity=5)
    spec = CPUOffloadingSpec(cfg)
    assert spec.config is cfg
    assert spec.get_manager().event_log is None


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (
            {"gpu_block_size": "16", "num_cpu_blocks": 8},
            "gpu_block_size must be a positive integer, got '16'",
        ),
        (
            {"gpu_block_size": 16, "num_cpu_blocks": "8"},
            "num_cpu_blocks must be a positive integer, got '8'",
        ),
        (
            {"gpu_block_size": 16, "num_cpu_blocks": True},
            "num_cpu_blocks must be a positive integer, got True",
        ),
        (
            {"gpu_block_size": 16, "num_cpu_blocks": 8, "offloaded_block_size": 32.0},
            "offloaded_block_size must be a positive integer, got 32.0",
        ),
        (
            {"gpu_block_size": 16, "num_cpu_blocks": 8, "enable_events": "false"},
            "enable_events must be True or False, got 'false'",
        ),
    ],
)
def test_typed_config_takes_its_types_only(kwargs: dict[str, object], says: str) -> None:
    # "16" once passed the check, then raised a TypeError from a % deep in it;
    # "8" passed, and get_manager() failed; "false" turned events on
    with pytest.raises(ConfigError, match=re.escape(says)):
        OffloadingConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [[1.7], ["3"], [True], [1, None], [[0.5, 1]]])
def test_block_ids_that_are_not_integers_are_refused(ids: list[object]) -> None:
    # once rounded or parsed: GPULoadStoreSpec([1.7]) named block 1, and a
    # store of it copied block 1
    from kvoffload import GPULoadStoreSpec

    with pytest.raises(ValueError, match="block ids must be integers"):
        GPULoadStoreSpec(ids)  # type: ignore[arg-type]
    assert GPULoadStoreSpec([]).block_ids.dtype == np.int64  # empty is fine
    assert GPULoadStoreSpec([[1, 2], [3, 4]]).block_ids.tolist() == [1, 2, 3, 4]
