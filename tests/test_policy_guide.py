"""docs/writing-a-policy.md: its example policy works as the guide says,
inside a manager and through ``kvoffload replay --import``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest

import kvoffload.policies as policies
from kvoffload import CPUBackend, PolicyOffloadingManager

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "writing-a-policy.md"
TRACE = REPO / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def _example() -> str:
    match = re.search(
        r"## A complete example: FIFO\n.*?```python\n(.*?)```", GUIDE.read_text(), re.S
    )
    assert match is not None, "the guide lost its example"
    return match.group(1)


def test_guide_example_is_a_working_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    # run the example as the module it says it is, without leaving "fifo"
    # registered for the other tests
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))
    module = types.ModuleType("fifo_guide_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(_example(), str(GUIDE), "exec"), module.__dict__)
    assert "fifo" in policies.available_policies()

    m = PolicyOffloadingManager(CPUBackend(16, 3), policy="fifo")
    hashes = [bytes([i]) for i in range(5)]
    for h in hashes[:3]:
        out = m.prepare_store([h])
        assert out is not None
        m.complete_store([h])
    m.touch([hashes[0]])  # FIFO ignores it: 0 still goes first
    m.prepare_load([hashes[1]])  # pinned: passed, 2 goes next
    out = m.prepare_store(hashes[3:5])
    assert out is not None and out.block_hashes_evicted == [hashes[0], hashes[2]]
    assert m.lookup([hashes[1]]) == 1
    assert m.stats().lists == {"fifo": 3}  # the list's name, as the IntEnum says
    m.switch_policy("lru")  # live switch out of the new policy keeps every block
    assert len(m) == 3 and m.stats().counters.evictions == {"fifo": 2, "lru": 0}


def test_guide_a_policy_registered_in_a_conftest_runs_the_core_suite(tmp_path: Path) -> None:
    # "register yours where the tests import (for example in a conftest.py)
    # and run pytest tests/core": the contract suite's fixtures then include it
    shutil.copytree(REPO / "tests" / "core", tmp_path / "tests" / "core")
    (tmp_path / "fifo_policy.py").write_text(_example())
    (tmp_path / "conftest.py").write_text("import fifo_policy  # registers 'fifo'\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/core/test_contract.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    collected = done.stdout.splitlines()
    assert any("test_contract.py::" in t and "[fifo]" in t for t in collected), done.stdout


@pytest.mark.parametrize("named", [True, False])
def test_guide_example_runs_through_replay_import(tmp_path: Path, named: bool) -> None:
    # "with no --policy, replay runs every registered policy, yours included"
    (tmp_path / "fifo_policy.py").write_text(_example())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    chosen = ["--policy", "lru,fifo"] if named else []
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "replay", str(TRACE), "--import", "fifo_policy",
         *chosen, "--capacity", "5%", "--limit", "300", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ran = [run["policy"] for run in json.loads(done.stdout)["runs"]]
    assert ran == (["lru", "fifo"] if named else sorted([*policies.available_policies(), "fifo"]))


def test_guide_example_is_served_through_serve_imports(tmp_path: Path) -> None:
    """`kvoffload serve --imports fifo_policy --policy fifo` starts on it, and
    the admin API lists it and switches to and from it."""
    from tests.app.served import ADMIN, READ, ROOT, served

    (tmp_path / "fifo_policy.py").write_text(_example())
    path = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    with served("--imports", "fifo_policy", "--policy", "fifo", env=path) as s:
        got = httpx.get(f"{s.base}/v1/policy", headers=READ).json()
        assert got["policy"] == "fifo" and "fifo" in got["available"]
        for policy in ("lru", "fifo"):
            put = httpx.put(f"{s.base}/v1/policy", json={"policy": policy}, headers=ADMIN)
            assert put.status_code == 200 and put.json()["policy"] == policy, put.text
