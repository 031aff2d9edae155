"""The extra config of kvoffload.vllm.KVOffloadSpec: checked before vLLM's
base class sees it, every problem named at once with what is allowed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import kvoffload.policies as policies
from kvoffload import ConfigError, available_policies
from kvoffload.vllm import (
    EXTRA_CONFIG_KEYS,
    admin_port,
    lookahead,
    offloading_config,
    row_kernel,
)

BASE = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}


def test_offloading_config_reads_every_key() -> None:
    cfg = offloading_config(
        {
            **BASE,
            "num_cpu_blocks": 128,
            "block_size": 64,
            "eviction_policy": "kvarc",
            "event_log_capacity": "256",
        },
        32,
        enable_events=True,
    )
    assert cfg.event_log_capacity == 256
    assert (cfg.gpu_block_size, cfg.block_size, cfg.num_cpu_blocks) == (32, 64, 128)
    assert (cfg.eviction_policy, cfg.enable_events) == ("kvarc", True)
    assert (cfg.spec_name, cfg.spec_module_path) == ("KVOffloadSpec", "kvoffload.vllm")


def test_offloading_config_defaults_follow_vllm() -> None:
    cfg = offloading_config({**BASE, "num_cpu_blocks": 8}, 16)
    assert (cfg.block_size, cfg.eviction_policy, cfg.enable_events) == (16, "lru", False)
    assert cfg.event_log_capacity == 10_000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "num_cpu_blocks is required"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks must be a positive integer, got 0"),
        ({"num_cpu_blocks": -4}, "num_cpu_blocks must be a positive integer, got -4"),
        ({"num_cpu_blocks": True}, "num_cpu_blocks must be a positive integer, got True"),
        ({"num_cpu_blocks": 2.5}, "num_cpu_blocks must be a positive integer, got 2.5"),
        ({"num_cpu_blocks": "many"}, "num_cpu_blocks must be a positive integer, got 'many'"),
        (
            {"num_cpu_blocks": 8, "block_size": 48},
            "block_size 48 is not a positive multiple of vLLM's block size 32 "
            "(cache_config.block_size): use e.g. 32, 64, 128",
        ),
        ({"num_cpu_blocks": 8, "block_size": 0}, "block_size 0 is not a positive multiple"),
        ({"num_cpu_blocks": 8, "block_size": "big"}, "block_size 'big' is not a positive"),
        (
            {"num_cpu_blocks": 8, "eviction_policy": "mru"},
            f"eviction_policy 'mru' is unknown (registered policies: {', '.join(available_policies())})",
        ),
        ({"num_cpu_blocks": 8, "eviction_policy": ["lru"]}, "eviction_policy ['lru'] is unknown"),
        *[
            (
                {"num_cpu_blocks": 8, "admin_port": bad},
                f"admin_port must be an integer from 0 to 65535 (0: any free port), got {bad!r}",
            )
            for bad in (-1, 65536, 80.0, "8000", True, None)
        ],
        *[
            (
                {"num_cpu_blocks": 8, "lookahead": bad},
                f"lookahead must be an integer from 0 to {sys.maxsize} (waiting requests the "
                f"HintingScheduler hints; 0: none), got {bad!r}",
            )
            # 10**30 passed and then failed every schedule() (islice's limit)
            for bad in (-1, 8.0, "64", False, None, sys.maxsize + 1, 10**30)
        ],
        *[
            (
                {"num_cpu_blocks": 8, "row_kernel": bad},
                "row_kernel must be true (every CUDA copy by the row kernel), false (copy "
                f"engines only) or null (the handler chooses, the default), got {bad!r}",
            )
            for bad in (1, 0, "false", "auto")
        ],
        *[
            (
                {"num_cpu_blocks": 8, "policy_modules": bad},
                f"policy_modules must be a list of module names (modules that register "
                f"policies of their own), got {bad!r}",
            )
            for bad in ("mod", [""], [1], None)
        ],
        *[
            (
                {"num_cpu_blocks": 8, "event_log_capacity": bad},
                f"event_log_capacity must be a positive integer, got {bad!r}",
            )
            for bad in (0, -1, True, 2.5, "many", None)
        ],
        (
            {"num_cpu_blocks": 8, "policy_modules": ["no_such_policies_xyz"]},
            "policy_modules: cannot import 'no_such_policies_xyz': ModuleNotFoundError",
        ),
        (
            {"num_cpu_blocks": 8, "admin_prot": 9000},
            f"unknown key 'admin_prot' (valid keys: {', '.join(EXTRA_CONFIG_KEYS)})",
        ),
    ],
)
def test_offloading_config_names_the_problem_and_the_choices(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        offloading_config({**BASE, **extra}, 32)
    assert str(info.value).startswith(
        "kv_connector_extra_config for kvoffload.vllm.KVOffloadSpec: "
    )
    assert message in str(info.value)


def test_offloading_config_reports_every_problem_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        offloading_config(
            {"num_cpu_blocks": 0, "block_size": 40, "eviction_policy": "fifo", "x": 1}, 16
        )
    problems = str(info.value).split(": ", 1)[1].split("; ")
    assert [p.split()[0] for p in problems] == [
        "unknown",
        "num_cpu_blocks",
        "block_size",
        "eviction_policy",
    ]


@pytest.mark.parametrize(
    ("extra", "port"), [({}, None), ({"admin_port": 0}, 0), ({"admin_port": 65535}, 65535)]
)
def test_admin_port_absent_is_no_server_and_0_is_any_free_port(
    extra: dict[str, Any], port: int | None
) -> None:
    offloading_config({**BASE, "num_cpu_blocks": 8, **extra}, 16)  # valid
    assert admin_port(extra) == port


def test_admin_port_problem_is_reported_with_the_others() -> None:
    with pytest.raises(ConfigError) as info:
        offloading_config({"num_cpu_blocks": 0, "admin_port": 99999}, 16)
    problems = str(info.value).split(": ", 1)[1].split("; ")
    assert [p.split()[0] for p in problems] == ["num_cpu_blocks", "admin_port"]


@pytest.mark.parametrize(
    ("extra", "n"), [({}, 64), ({"lookahead": 0}, 0), ({"lookahead": 512}, 512)]
)
def test_lookahead_defaults_to_64_and_0_hints_nothing(extra: dict[str, Any], n: int) -> None:
    offloading_config({**BASE, "num_cpu_blocks": 8, **extra}, 16)  # valid
    assert lookahead(extra) == n


@pytest.mark.parametrize(
    ("extra", "choice"),
    [
        ({}, None),
        ({"row_kernel": None}, None),
        ({"row_kernel": False}, False),
        ({"row_kernel": True}, True),
    ],
)
def test_row_kernel_defaults_to_the_handler_s_choice(
    extra: dict[str, Any], choice: bool | None
) -> None:
    offloading_config({**BASE, "num_cpu_blocks": 8, **extra}, 16)  # valid
    assert row_kernel(extra) is choice


def test_row_kernel_reaches_the_handler() -> None:
    # The spec hands it to CpuGpuOffloadingHandler: True on CPU caches is the
    # handler's own refusal, naming what the kernel needs.
    torch = pytest.importorskip("torch")
    from kvoffload.spec import CPUOffloadingSpec

    spec = CPUOffloadingSpec(offloading_config({**BASE, "num_cpu_blocks": 4}, 16))
    kv = {"l0": torch.zeros(8, 16, 2, 4)}
    with pytest.raises(ConfigError, match=r"row_kernel=True needs KV tensors on CUDA"):
        spec.get_handler(kv, row_kernel=True)
    assert spec.get_handler(kv, row_kernel=False).num_cpu_blocks == 4


def test_policy_modules_are_imported_before_the_policy_is_looked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a policy of one's own inside vLLM: its module registers it in the
    # engine core's process, where the spec is made
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_vllm_policies.py").write_text(
        "from kvoffload.policies import register_policy\n"
        "from kvoffload.policies.lru import LRUPolicy\n"
        "class MinePolicy(LRUPolicy):\n"
        "    name = 'mine'\n"
        "register_policy('mine', 'my_vllm_policies:MinePolicy')\n"
    )
    extra = {**BASE, "num_cpu_blocks": 8, "eviction_policy": "mine"}
    with pytest.raises(ConfigError, match="eviction_policy 'mine' is unknown"):
        offloading_config(extra, 16)
    cfg = offloading_config({**extra, "policy_modules": ["my_vllm_policies"]}, 16)
    assert cfg.eviction_policy == "mine"
