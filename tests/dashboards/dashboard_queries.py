"""Reading the committed dashboards: their panels, their PromQL, the metrics it reads."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.instrumentation import METRICS_BY_NAME

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "dashboards"
DEPLOY_DIR = REPO / "deploy"

METRIC_NAME = re.compile(r"\bkvoffload_[a-z0-9_]+\b")
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

#: values the tests give Grafana's built-in variables ($job and $instance come on top)
GRAFANA_BUILTINS = {
    "__rate_interval": "20s",
    "__interval": "5s",
    "__range": "5m",
}
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One PromQL query of a dashboard: a panel target or an annotation."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    """The committed dashboards by file name."""
    return {
        path.name: json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(DASHBOARD_DIR.glob("*.json"))
    }


def iter_panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows; rows themselves excluded."""
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(dashboards: dict[str, dict[str, Any]]) -> list[PanelQuery]:
    """Every PromQL query: panel targets and Prometheus annotations."""
    queries = []
    for name, board in dashboards.items():
        for panel in iter_panels(board):
            for target in panel.get("targets", []):
                queries.append(PanelQuery(name, panel["title"], target["refId"], target["expr"]))
        for annotation in board.get("annotations", {}).get("list", []):
            if annotation.get("expr"):
                where = f"annotation {annotation['name']}"
                queries.append(PanelQuery(name, where, "-", annotation["expr"]))
    return queries


def metric_in_catalogue(series_name: str) -> bool:
    """Whether a series name belongs to a metric of kvoffload's catalogue."""
    if series_name in METRICS_BY_NAME:
        return True
    for suffix in _HISTOGRAM_SERIES:
        spec = METRICS_BY_NAME.get(series_name.removesuffix(suffix))
        if series_name.endswith(suffix) and spec is not None and spec.type == "histogram":
            return True
    return False


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana variables replaced; an unknown variable is an error."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return variables[name]

    return _VARIABLE.sub(value, expr)


def docs_promql_examples() -> list[str]:
    """The expressions of docs/observability.md's PromQL block: one per
    unindented line, indented lines continuing it, comments skipped."""
    text = (REPO / "docs" / "observability.md").read_text(encoding="utf-8")
    block = text.split("```promql\n", 1)[1].split("```", 1)[0]
    exprs: list[str] = []
    for line in block.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0].isspace():
            exprs[-1] += " " + line.strip()
        else:
            exprs.append(line.strip())
    return exprs
