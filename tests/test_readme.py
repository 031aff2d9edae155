"""The README's examples must keep working: its embedding snippet runs as written."""

from __future__ import annotations

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
