"""The ``vllm`` fixture: vLLM 0.11.2's own managers (see ``bench/vllm_ref.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "vllm_ref.py"


def _vllm_ref() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvoffload_bench_vllm_ref", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


vllm_ref = _vllm_ref()


@pytest.fixture(scope="session")
def vllm() -> Any:
    try:
        return vllm_ref.load_vllm()
    except vllm_ref.VLLMUnavailable as e:
        pytest.skip(f"vLLM {vllm_ref.VERSION} is not available: {e}")
