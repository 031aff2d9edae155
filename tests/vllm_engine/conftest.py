"""The engine tier: kvoffload inside a real vLLM 0.11.2 engine (CPU build).

Runs in the environment scripts/vllm-env builds (scripts/test-vllm); the
main suite never collects it. Every engine runs the workload of
:mod:`.workload` on a tiny random-weight model made in a temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .workload import ENGINE_ENV, Run, kvoffload_extra, run_workload

# Before vLLM is imported: its envs module reads them on first use.
os.environ.update(ENGINE_ENV)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .model import make_model

    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def baseline(model_dir: Path) -> Run:
    """The workload without offloading."""
    return run_workload(model_dir, None)


@pytest.fixture(scope="session")
def offloaded(model_dir: Path) -> Callable[..., Run]:
    """``offloaded(**extra)``: the workload with kvoffload's tier configured
    by ``extra`` (spec name and module added), each configuration run once."""
    runs: dict[str, Run] = {}

    def get(**extra: Any) -> Run:
        key = repr(sorted(extra.items()))
        if key not in runs:
            runs[key] = run_workload(model_dir, kvoffload_extra(**extra))
        return runs[key]

    return get
