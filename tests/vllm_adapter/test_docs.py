"""docs/vllm.md backs its claims with tests: the ones it names exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "vllm.md").read_text()


def test_vllm_doc_names_tests_that_exist() -> None:
    defined = {
        m.group(1)
        for f in (ROOT / "tests").rglob("test_*.py")
        for m in re.finditer(r"^def (test_\w+)", f.read_text(), re.M)
    }
    named = set(re.findall(r"`(test_\w+)`", DOC))
    assert named, "docs/vllm.md names no test"
    assert named <= defined, sorted(named - defined)


def test_vllm_doc_paths_exist() -> None:
    paths = set(re.findall(r"`((?:tests|scripts|kvoffload)/[\w/.]+)`", DOC))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []
