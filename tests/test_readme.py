"""The README's examples must keep working: its embedding snippet runs as
written, and so does observability.md's wiring of an engine to both exporters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_embedding_snippet_runs() -> None:
    text = README.read_text()
    match = re.search(r"## Embedding the library\n\n```python\n(.*?)```", text, re.S)
    assert match is not None, "README lost its embedding example"
    snippet = match.group(1)
    assert len(snippet.strip().splitlines()) <= 20, "the embedding example should stay short"
    out = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "ManagerStats(policy='lru'" in out.stdout


def test_readme_quick_start_is_two_commands_that_exist() -> None:
    text = README.read_text()
    match = re.search(r"## Quick start\n.*?```bash\n(.*?)```", text, re.S)
    assert match is not None, "README lost its quick start"
    commands = [line.split("#")[0].strip() for line in match.group(1).strip().splitlines()]
    assert commands == ["./scripts/serve", "./scripts/test"]
    root = README.parent
    for command in commands:
        script = root / command
        assert script.is_file() and script.stat().st_mode & 0o111, f"{command} is not executable"
    assert "scripts/test" in (root / ".ci" / "run").read_text()


def test_observability_wiring_snippet_runs() -> None:
    text = (README.parent / "docs" / "observability.md").read_text()
    match = re.search(
        r"```python\n(from prometheus_client import CollectorRegistry\n.*?)```", text, re.S
    )
    assert match is not None, "observability.md lost its wiring example"
    # the snippet's "..." is where the host serves the registry: read it there
    snippet = match.group(1).replace(
        "\n...", "\nimport time; time.sleep(0.5)\nprint(generate_latest(registry).decode())\n#", 1
    )
    program = "from prometheus_client import generate_latest\n" + snippet
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=README.parent,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    steps = re.search(r"^kvoffload_runtime_steps_total (\S+)$", out.stdout, re.M)
    assert steps is not None and float(steps.group(1)) > 0, out.stdout[-2000:]
