"""kvoffload.vllm imports vLLM only when vLLM asks it for KVOffloadSpec."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import kvoffload.vllm

HEAVY = ("vllm", "torch", "fastapi", "prometheus_client", "opentelemetry", "uvicorn")


def _run(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_vllm_package_import_loads_neither_vllm_nor_torch() -> None:
    loaded = _run(
        "import json, sys\n"
        "import kvoffload.vllm\n"
        "from kvoffload.vllm import ReportingHandler, live_managers, offloading_config\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps({'loaded': sorted(m for m in sys.modules "
        "if m.split('.')[0] in heavy)}))"
    )["loaded"]
    assert loaded == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_spec_without_vllm_says_what_is_missing() -> None:
    result = _run(
        "import json\n"
        "import kvoffload.vllm\n"
        "try:\n"
        "    kvoffload.vllm.KVOffloadSpec\n"
        "except ImportError as exc:\n"
        "    print(json.dumps({'error': str(exc)}))\n"
    )
    assert "kvoffload.vllm.KVOffloadSpec needs vLLM 0.11.2 installed" in str(result["error"])


def test_vllm_package_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = kvoffload.vllm.Nope
