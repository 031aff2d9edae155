"""The top-level package: its exports and what importing it loads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import kvoffload
import kvoffload.vllm

HEAVY = ("torch", "vllm", "fastapi", "prometheus_client", "opentelemetry", "starlette", "uvicorn")


def _run(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_public_api_import_loads_no_heavy_stack() -> None:
    loaded = _run(
        "import json, sys\n"
        "import kvoffload\n"
        "from kvoffload import *\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps({'loaded': sorted(m for m in sys.modules "
        "if m.split('.')[0] in heavy)}))"
    )["loaded"]
    assert loaded == []


def test_public_api_all_is_pinned() -> None:
    assert sorted(kvoffload.__all__) == kvoffload.__all__
    assert kvoffload.__all__ == [
        "ARCOffloadingManager",
        "Backend",
        "BlockHash",
        "BlockStateError",
        "BlockStatus",
        "CPUBackend",
        "CPULoadStoreSpec",
        "CPUOffloadingSpec",
        "ConfigError",
        "EventLog",
        "EventPage",
        "EventRecord",
        "EvictionPolicy",
        "GPULoadStoreSpec",
        "KVOffloadError",
        "LRUOffloadingManager",
        "LoadStoreSpec",
        "ManagerCounters",
        "ManagerStats",
        "OffloadingConfig",
        "OffloadingEvent",
        "OffloadingHandler",
        "OffloadingManager",
        "OffloadingSpec",
        "OffloadingSpecFactory",
        "OffloadingWorker",
        "PolicyContractError",
        "PolicyError",
        "PolicyFailedError",
        "PolicyOffloadingManager",
        "PrepareStoreOutput",
        "TransferError",
        "TransferResult",
        "TransferSpec",
        "UnknownTicketError",
        "WindowStats",
        "__version__",
        "available_policies",
    ]
    for name in kvoffload.__all__:
        assert getattr(kvoffload, name) is not None


def test_public_api_vllm_names_are_exported() -> None:
    vllm_names = {
        "BlockHash",
        "LoadStoreSpec",
        "PrepareStoreOutput",
        "OffloadingEvent",
        "OffloadingManager",
        "BlockStatus",
        "Backend",
        "CPUBackend",
        "CPULoadStoreSpec",
        "GPULoadStoreSpec",
        "LRUOffloadingManager",
        "ARCOffloadingManager",
        "OffloadingSpec",
        "CPUOffloadingSpec",
        "OffloadingSpecFactory",
        "OffloadingHandler",
        "OffloadingWorker",
        "TransferSpec",
        "TransferResult",
    }
    assert vllm_names <= set(kvoffload.__all__)


def test_public_api_errors_share_one_base() -> None:
    for name in (
        "BlockStateError",
        "ConfigError",
        "PolicyError",
        "PolicyFailedError",
        "TransferError",
        "UnknownTicketError",
    ):
        assert issubclass(getattr(kvoffload, name), kvoffload.KVOffloadError)


def test_public_api_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = kvoffload.Nope


def test_public_api_cpu_gpu_handler_loads_lazily() -> None:
    result = _run(
        "import json, sys\n"
        "import kvoffload\n"
        "before = 'torch' in sys.modules\n"
        "cls = kvoffload.CpuGpuOffloadingHandler\n"
        "from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler\n"
        "print(json.dumps({'before': before, 'after': 'torch' in sys.modules,\n"
        "    'same': cls is CpuGpuOffloadingHandler,\n"
        "    'handler': issubclass(cls, kvoffload.OffloadingHandler)}))"
    )
    assert result == {"before": False, "after": True, "same": True, "handler": True}


def test_public_api_vllm_adapter_loads_vllm_only_for_its_spec() -> None:
    result = _run(
        "import json, sys\n"
        "import kvoffload.vllm\n"
        "from kvoffload.vllm import ReportingHandler, live_managers, offloading_config\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "try:\n"
        "    kvoffload.vllm.KVOffloadSpec\n"
        "    error = None\n"
        "except ImportError as exc:\n"
        "    error = str(exc)\n"
        "print(json.dumps({'loaded': loaded, 'error': error}))"
    )
    assert result["loaded"] == []
    if importlib.util.find_spec("vllm") is None:  # the main venv: no vLLM
        assert "kvoffload.vllm.KVOffloadSpec needs vLLM 0.11.2 installed" in str(result["error"])
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = kvoffload.vllm.Nope


def _table_choice(env: dict[str, str], block_c: bool) -> dict[str, object]:
    """Which block table a fresh interpreter picks, and what it warned."""
    code = (
        "import json, sys, warnings\n"
        + (
            "sys.modules['kvoffload._table'] = None  # as if it was never built\n"
            if block_c
            else ""
        )
        + "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import kvoffload\n"
        "    from kvoffload.table import IMPLEMENTATION, BlockTable\n"
        "    m = kvoffload.LRUOffloadingManager(kvoffload.CPUBackend(16, 2))\n"
        "print(json.dumps({'impl': IMPLEMENTATION, 'cls': BlockTable.__module__,\n"
        "    'used': type(m.table).__module__,\n"
        "    'warnings': [str(w.message) for w in caught]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVOFFLOAD_PURE_PYTHON": "", **env},
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_managers_use_the_c_block_table_when_it_is_built() -> None:
    got = _table_choice({}, block_c=False)
    assert got == {
        "impl": "c",
        "cls": "kvoffload._table",
        "used": "kvoffload._table",
        "warnings": [],
    }


def test_a_missing_c_table_falls_back_to_python_and_says_so() -> None:
    got = _table_choice({}, block_c=True)
    assert got["impl"] == "python" and got["used"] == "kvoffload.table"
    (warning,) = got["warnings"]  # type: ignore[misc]
    assert "C block table is not available" in warning
    assert "KVOFFLOAD_PURE_PYTHON=1" in warning  # how to choose it knowingly


def test_pure_python_table_can_be_chosen_without_a_warning() -> None:
    got = _table_choice({"KVOFFLOAD_PURE_PYTHON": "1"}, block_c=False)
    assert got == {
        "impl": "python",
        "cls": "kvoffload.table",
        "used": "kvoffload.table",
        "warnings": [],
    }
