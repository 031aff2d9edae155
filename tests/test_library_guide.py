"""docs/library.md: its examples run, in order, in one fresh process, and
check themselves (each block asserts what the text around it says)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def test_library_guide_examples_run_as_written() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 6, "the guide lost examples"
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "cannot load block b'nope'" in out  # the error the first example prints
    assert "must be a multiple of" in out
    assert re.search(r"^belady \d\.\d+$", out, re.M)
