"""Values of the wrong type or out of range are refused where they are given,
with an error that names them, not later with a raw TypeError (or a hang)."""

from __future__ import annotations

import math
import re

import pytest

from kvoffload import CPUBackend, PolicyOffloadingManager
from kvoffload.errors import ConfigError
from kvoffload.runtime import Engine, HostedManager
from kvoffload.runtime.commands import check_version
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.workloads import WorkloadError

# ------------------------------------------------------------------ SyntheticConfig


@pytest.mark.parametrize(
    "name",
    ["requests_per_second", "chat_weight", "mean_turns", "zipf_exponent"],
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, True, "2", None, 10**400])
def test_synthetic_float_parameters_are_finite_numbers(name: str, value: object) -> None:
    # mean_turns=inf passed and the first chat turn looped forever (stop = 1/inf)
    with pytest.raises(WorkloadError, match=f"^{name}|^mix weights") as info:
        SyntheticWorkload(SyntheticConfig(**{name: value}))  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # a mean of 1e12 turns took for ever to draw; 200 overflowed rank ** 200
        ("mean_turns", 1e12, "mean_turns must be a number from 1 to 10000, got 1000000000000.0"),
        ("mean_turns", 0.5, "mean_turns must be a number from 1 to 10000, got 0.5"),
        ("zipf_exponent", 200.0, "zipf_exponent must be a number from 0 to 10, got 200.0"),
    ],
)
def test_synthetic_shape_parameters_are_bounded(name: str, value: float, message: str) -> None:
    with pytest.raises(WorkloadError, match=re.escape(message)):
        SyntheticConfig(**{name: value}).validate()  # type: ignore[arg-type]


def test_synthetic_weights_must_have_a_finite_sum() -> None:
    big = 1.5e308  # each finite, the sum is not: every share would be 0
    with pytest.raises(WorkloadError, match="positive, finite sum"):
        SyntheticConfig(chat_weight=big, document_weight=big).validate()


@pytest.mark.parametrize("value", [None, 1.5, True, "1"])
def test_synthetic_seed_is_an_integer(value: object) -> None:
    # seed=None was taken, and every pass of the workload differed
    with pytest.raises(WorkloadError, match=re.escape(f"seed must be an integer, got {value!r}")):
        SyntheticWorkload(SyntheticConfig(seed=value))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_requests", 1.5),
        ("num_requests", True),
        ("num_requests", "10"),
        ("trace_block_size", 0.5),
        ("trace_block_size", True),
        ("num_system_prompts", 2.0),
        ("open_chats", True),
        ("num_documents", "20"),
        ("system_prompt_blocks", 1.5),
    ],
)
def test_synthetic_counts_are_integers(name: str, value: object) -> None:
    with pytest.raises(WorkloadError, match=f"^{name} must be an integer") as info:
        SyntheticWorkload(SyntheticConfig(**{name: value}))  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "value",
    [(2.5, 3), (1, 4.0), (True, 2), [1, 4], (1,), (1, 2, 3), "14", None, (5, 2), (0, 3)],
)
def test_synthetic_ranges_are_tuples_of_integers(value: object) -> None:
    # (2.5, 3) passed and randrange raised a ValueError mid-iteration
    with pytest.raises(WorkloadError, match=r"^turn_blocks must be a \(low, high\) tuple") as info:
        SyntheticWorkload(SyntheticConfig(turn_blocks=value))  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_synthetic_takes_ints_for_its_float_parameters() -> None:
    ints = SyntheticConfig(
        num_requests=50, requests_per_second=20, mean_turns=5, chat_weight=1, zipf_exponent=1
    )
    floats = SyntheticConfig(
        num_requests=50, requests_per_second=20.0, mean_turns=5.0, chat_weight=1.0
    )
    assert list(SyntheticWorkload(ints)) == list(SyntheticWorkload(ints))
    assert len(list(SyntheticWorkload(floats))) == 50


# --------------------------------------------------------------------- EngineConfig


@pytest.mark.parametrize("value", ["2", True, 0, math.nan, [1]])
def test_engine_speed_is_a_number_or_none(value: object) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"speed must be a number > 0 or None, got {value!r}")
    ):
        EngineConfig(speed=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["0.1", None, True, False, -0.1, 1.5, math.nan])
def test_engine_failure_rate_is_a_number_in_range(value: object) -> None:
    # True was taken as a rate of 1: every transfer failed
    with pytest.raises(
        ConfigError,
        match=re.escape(f"inject_failure_rate must be a number within [0, 1], got {value!r}"),
    ):
        EngineConfig(inject_failure_rate=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "int8", "dtype must be one of float16, bfloat16, float32, got 'int8'"),
        ("dtype", None, "dtype must be one of float16, bfloat16, float32, got None"),
        ("kv_layout", "x", "kv_layout must be 'kv_first' or 'blocks_first', got 'x'"),
        ("device", "tpu", "device must be 'auto', 'cpu' or 'cuda[:n]', got 'tpu'"),
        ("device", None, "device must be 'auto', 'cpu' or 'cuda[:n]', got None"),
        ("device", "cuda:", "device must be 'auto', 'cpu' or 'cuda[:n]', got 'cuda:'"),
        ("device", "cuda:x", "device must be 'auto', 'cpu' or 'cuda[:n]', got 'cuda:x'"),
    ],
)
def test_engine_config_checks_the_tensor_names(field: str, value: object, message: str) -> None:
    # these were taken by the config and refused only by Engine(...)
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_engine_config_takes_every_device_form(device: str) -> None:
    # whether the device is on this machine is the engine's question, not the config's
    assert EngineConfig(device=device).device == device


# ------------------------------------------------------------------- HostedManager


def _manager() -> PolicyOffloadingManager:
    return PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=4), policy="lru")


@pytest.mark.parametrize("value", ["0.05", None, math.nan, math.inf, -0.01, True, 10**400])
def test_hosted_snapshot_max_age_is_a_finite_number(value: object) -> None:
    # "0.05" or None made prepare_store raise after the manager took the block
    with pytest.raises(ConfigError) as info:
        HostedManager(_manager(), snapshot_max_age=value)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"snapshot_max_age must be a finite number of seconds >= 0, got {value!r}"
    )


@pytest.mark.parametrize("value", [0, 0.0, 0.05, 2])
def test_hosted_snapshot_max_age_takes_numbers(value: float) -> None:
    hosted = HostedManager(_manager(), snapshot_max_age=value)
    assert hosted.prepare_store([b"a"]) is not None
    assert hosted.snapshot_max_age == value


def test_hosted_snapshot_max_age_zero_publishes_after_every_call() -> None:
    hosted = HostedManager(_manager(), snapshot_max_age=0)
    hosted.prepare_store([b"a"])
    assert hosted.snapshot().step == 1


# ---------------------------------------------------------------- expected_version


@pytest.mark.parametrize("value", ["1", True, 1.0])
def test_hosted_switch_expected_version_is_an_integer(value: object) -> None:
    # "1" failed the future with "policy version is 1, not the expected 1";
    # True was taken as version 1
    hosted = HostedManager(_manager())
    with pytest.raises(
        ConfigError, match=re.escape(f"expected_version must be an integer or None, got {value!r}")
    ):
        hosted.switch_policy("arc", expected_version=value)  # type: ignore[arg-type]
    assert hosted.policy_name == "lru"
    assert hosted.switch_policy("arc", expected_version=1).result(timeout=1).policy_version == 2


def test_engine_switch_expected_version_is_an_integer() -> None:
    engine = Engine(
        EngineConfig(num_gpu_blocks=16, num_cpu_blocks=8, device="cpu"),
        SyntheticWorkload(SyntheticConfig(num_requests=4, trace_block_size=64)),
    )
    with pytest.raises(ConfigError, match="expected_version must be an integer or None"):
        engine.switch_policy("arc", expected_version="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected_version must be an integer or None"):
        engine.switch_policy("arc", expected_version=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["1", True])
def test_check_version_refuses_what_is_not_an_integer(value: object) -> None:
    with pytest.raises(ConfigError, match="expected_version must be an integer or None"):
        check_version(value, 1)  # type: ignore[arg-type]
