"""docs/observability.md: its wiring example runs as written (with a short
run where it says ``...``) and exports what it wires up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"

CHECK = """
engine.run(max_steps=30)
from prometheus_client import generate_latest
text = generate_latest(registry).decode()
for name in ("kvoffload_capacity_blocks", "kvoffload_config_info", "kvoffload_runtime_steps_total 30.0"):
    assert name in text, name
print("steps", engine.snapshot().step)
"""


def test_the_wiring_example_runs_and_exports_metrics() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    example = next(b for b in blocks if "KVOffloadCollector(" in b and "setup_telemetry" in b)
    where = re.search(r"\n\.\.\.  # run it: engine\.start\(\)[^\n]*\n", example)
    assert where, "the example lost its '...' (where the engine runs, and how)"
    code = example.replace(where.group(0), "\n" + CHECK + "\n", 1)
    env = {"PATH": "/usr/bin:/bin"}  # no OTEL_* endpoint: telemetry is off, not an error
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
        cwd=DOC.parents[1], check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^steps 30$", done.stdout, re.M), done.stdout
