"""The repository carries the traces it replays: byte-identical upstream
copies, described correctly by data/traces/README.md, and nothing in the
project reads data from outside the repository."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "data" / "traces"
README = (TRACES / "README.md").read_text()


def _table_rows() -> dict[str, list[str]]:
    rows = {}
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith("`mooncake_"):
            rows[cells[0].strip("`")] = cells
    return rows


ROWS = _table_rows()


def test_readme_describes_both_traces() -> None:
    assert sorted(ROWS) == sorted(p.name for p in TRACES.glob("*.jsonl"))
    assert sorted(ROWS) == ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_trace_matches_its_readme_row(name: str) -> None:
    _, _, rows, accesses, unique, _span, size, sha = ROWS[name]
    data = (TRACES / name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == sha.strip("`")
    assert len(data) == int(size.replace(",", ""))
    requests = [json.loads(line) for line in data.splitlines()]
    assert len(requests) == int(rows.replace(",", ""))
    ids = [h for r in requests for h in r["hash_ids"]]
    assert len(ids) == int(accesses.replace(",", ""))
    assert len(set(ids)) == int(unique.replace(",", ""))


def test_nothing_reads_a_path_outside_the_repository() -> None:
    # A user's clone has nothing beside it; the development checkout has a
    # sibling folder of shared files that must never be relied on. Its name
    # is spelled in pieces here, so this test does not name the path itself.
    sibling = "shared"
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    pattern = re.compile(rf"\.\./{sibling}|[\"']{sibling}[\"']\s*/|parents?\b.*{sibling}/data")
    offenders = [
        f
        for f in files
        if (REPO / f).is_file()
        and not f.startswith("data/")
        and pattern.search((REPO / f).read_text(errors="replace"))
    ]
    assert offenders == []
