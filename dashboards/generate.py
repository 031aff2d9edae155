"""Write the dashboards' JSON next to this file.

Run from the repository root::

    .venv/bin/python -m dashboards.generate          # (re)write the JSON
    .venv/bin/python -m dashboards.generate --check  # exit 1 if the JSON is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python dashboards/generate.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from dashboards import overview

HERE = Path(__file__).resolve().parent

#: file name -> function building the dashboard
DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "kvoffload-overview.json": overview.build,
}


def render(board: Dashboard) -> str:
    """The dashboard as stable, diff-friendly JSON."""
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write to")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = args.out / name
        text = render(build())
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for path in stale:
        print(f"{path} is out of date: run python -m dashboards.generate", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
