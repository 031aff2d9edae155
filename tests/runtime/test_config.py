"""EngineConfig refuses what is not of its fields' types."""

from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError
from kvoffload.runtime.config import EngineConfig


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("value", [True, 0, 2.0, "2"])
def test_tensor_shape_fields_are_positive_integers(name: str, value: object) -> None:
    # num_layers=True was taken (bools were refused for the other counts only)
    with pytest.raises(ConfigError, match=f"{name} must be a positive integer"):
        EngineConfig(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["x", 1.5, True])
def test_seed_is_an_integer(value: object) -> None:
    with pytest.raises(ConfigError, match="seed must be an integer"):
        EngineConfig(seed=value)  # type: ignore[arg-type]
