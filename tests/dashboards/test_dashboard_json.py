"""The committed dashboards: generated from code, documented, and built on real metrics."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from dashboard_queries import (
    DASHBOARD_DIR,
    GRAFANA_BUILTINS,
    METRIC_NAME,
    REPO,
    PanelQuery,
    iter_panels,
    metric_in_catalogue,
    substitute,
)

from kvoffload.instrumentation import METRICS_BY_NAME

SCOPE = 'job="$job", instance=~"$instance"'
COUNTER_FUNCTIONS = {"rate", "irate", "increase"}
#: a metric name and the function applied to it directly, if any: ``rate(kvoffload_x{``
_USE = re.compile(r"(?:(\w+)\s*\(\s*)?\b(kvoffload_[a-z0-9_]+)\b")


def test_generator_reproduces_the_committed_json(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "dashboards.generate", "--out", str(tmp_path)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    generated = {path.name: path.read_text(encoding="utf-8") for path in tmp_path.glob("*.json")}
    committed = {
        path.name: path.read_text(encoding="utf-8") for path in DASHBOARD_DIR.glob("*.json")
    }
    assert sorted(generated) == sorted(committed), (
        "a dashboard JSON has no generator, or not committed"
    )
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"stale dashboards {stale}: run python -m dashboards.generate"


def test_generate_check_flags_a_stale_file(tmp_path: Path) -> None:
    (tmp_path / "kvoffload-overview.json").write_text("{}\n", encoding="utf-8")
    check = subprocess.run(
        [sys.executable, "-m", "dashboards.generate", "--check", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 1
    assert "out of date" in check.stderr


def test_every_panel_has_a_unit_and_a_description_naming_its_metrics(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    problems = []
    for name, board in dashboards.items():
        for panel in iter_panels(board):
            where = f"{name} / {panel['title']}"
            description = panel.get("description", "")
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            if not unit:
                problems.append(f"{where}: no unit")
            if not description.strip():
                problems.append(f"{where}: no description")
            for target in panel.get("targets", []):
                for metric in METRIC_NAME.findall(target["expr"]):
                    if metric not in description:
                        problems.append(f"{where}: description does not name {metric}")
    assert not problems, "\n".join(problems)


def test_every_queried_metric_is_in_the_catalogue(queries: list[PanelQuery]) -> None:
    unknown = {
        (query.where, metric)
        for query in queries
        for metric in METRIC_NAME.findall(query.expr)
        if not metric_in_catalogue(metric)
    }
    assert not unknown, sorted(unknown)


def test_counters_are_only_read_through_rates(queries: list[PanelQuery]) -> None:
    """A raw counter (or bucket) on a graph is a bug, and so is rate() of a gauge."""
    problems = []
    for query in queries:
        for function, metric in _USE.findall(query.expr):
            spec = METRICS_BY_NAME.get(metric)
            is_counter = (
                spec.type == "counter" if spec else metric.endswith(("_bucket", "_sum", "_count"))
            )
            if is_counter and function not in COUNTER_FUNCTIONS:
                problems.append(f"{query.where}: counter {metric} read without rate()/increase()")
            if not is_counter and function in COUNTER_FUNCTIONS:
                problems.append(f"{query.where}: {function}() of gauge {metric}")
    assert not problems, "\n".join(problems)


def test_no_panel_divides_by_zero_or_plots_an_empty_quantile(queries: list[PanelQuery]) -> None:
    """With no traffic (a paused engine, an idle range) a ratio of rates is
    0/0 and a quantile of empty buckets is NaN: both once showed NaN. Every
    division's denominator is filtered to > 0 and every quantile to >= 0, so
    the panel has no value there instead."""
    problems = []
    for query in queries:
        expr = " ".join(query.expr.split())
        for position in (m.start() for m in re.finditer(r"(?<![<>=!])/", expr)):
            rest = expr[position + 1 :].lstrip()
            if not (rest.startswith("(") and re.match(r"\(.*> 0\)", rest)):
                problems.append(f"{query.where}: unguarded division")
        if "histogram_quantile(" in expr and not expr.endswith(">= 0"):
            problems.append(f"{query.where}: a quantile that can be NaN")
    assert not problems, "\n".join(problems)


def test_no_ratio_metric_is_read(queries: list[PanelQuery]) -> None:
    """Ratios are computed from counters (DESIGN section 6), never read from a gauge."""
    ratios = [
        f"{query.where}: {metric}"
        for query in queries
        for metric in METRIC_NAME.findall(query.expr)
        if "ratio" in metric.split("_")
    ]
    assert not ratios, ratios


def test_every_selector_is_scoped_by_job_and_instance(queries: list[PanelQuery]) -> None:
    unscoped = [
        f"{query.where}: {metric}"
        for query in queries
        for metric in METRIC_NAME.findall(query.expr)
        if f"{metric}{{{SCOPE}" not in query.expr
    ]
    assert not unscoped, unscoped


def test_queries_use_only_known_variables(queries: list[PanelQuery]) -> None:
    known = {**GRAFANA_BUILTINS, "job": "j", "instance": "i"}
    for query in queries:
        substitute(query.expr, known)  # raises on an unknown variable


def test_queries_parse_as_promql(queries: list[PanelQuery], promtool: str, tmp_path: Path) -> None:
    """promtool parses every query (as a recording rule), no Prometheus needed."""
    variables = {**GRAFANA_BUILTINS, "job": "kvoffload", "instance": ".*"}
    rules = [
        {"record": f"dashboard:query_{index}", "expr": substitute(query.expr, variables)}
        for index, query in enumerate(queries)
    ]
    rules_file = tmp_path / "dashboard-queries.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    check = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_panels_have_unique_ids_and_fit_the_grid(dashboards: dict[str, dict[str, Any]]) -> None:
    for name, board in dashboards.items():
        panels = board["panels"]
        ids = [panel["id"] for panel in panels]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells: dict[tuple[int, int], str] = {}
        for panel in panels:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, f"{name} / {panel['title']} overflows the grid"
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    other = cells.setdefault((x, y), panel["title"])
                    assert other == panel["title"], f"{name}: {other} overlaps {panel['title']}"


def test_queries_use_the_datasource_variable(dashboards: dict[str, dict[str, Any]]) -> None:
    for name, board in dashboards.items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert {"job", "instance"} <= set(variables), name
        for panel in iter_panels(board):
            refs = [panel["datasource"], *(t["datasource"] for t in panel.get("targets", []))]
            for ref in refs:
                assert ref == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_overview_shows_what_operators_need(dashboards: dict[str, dict[str, Any]]) -> None:
    board = dashboards["kvoffload-overview.json"]
    panels = {panel["title"]: panel for panel in iter_panels(board)}
    exprs = {
        title: " ".join(t["expr"] for t in panel.get("targets", []))
        for title, panel in panels.items()
    }
    stats = [p["title"] for p in iter_panels(board) if p["type"] == "stat"]
    # "What is my hit ratio": one headline from counters, the CPU tier's share beside it
    assert stats[:2] == ["Prompt tokens reused", "From the CPU tier"]
    reused = exprs["Prompt tokens reused"]
    for outcome in ("gpu_hit", "cpu_hit"):
        assert f'kvoffload_runtime_prompt_tokens_total{{{SCOPE}, outcome="{outcome}"}}' in reused
    assert 'outcome="computed"' not in reused and "increase(" in reused
    assert 'outcome="cpu_hit"' in exprs["From the CPU tier"]
    # "Why did it change": markers per switch (from and to) and per command, the count
    annotations = {a["name"]: a for a in board["annotations"]["list"]}
    switches = annotations["Policy switches"]
    assert "kvoffload_policy_switch_info" in switches["expr"]
    assert "{{previous_policy}} -> {{policy}}" in switches["textFormat"]
    commands = annotations["Pause, resume, reset"]
    assert 'command=~"pause|resume|reset"' in commands["expr"]
    for marker in (switches, commands):
        assert marker["useValueForTime"] is True and marker["expr"].startswith("1000 * ")
    assert "kvoffload_policy_switches_total" in exprs["Policy switches"]
    # "What is the cache doing": resident lists apart from ghosts, free blocks, parameters
    assert "kvoffload_policy_list_blocks" in exprs["Resident blocks by list"]
    assert "ghost" not in exprs["Resident blocks by list"]
    assert "kvoffload_policy_ghost_entries" in exprs["Ghost lists"]
    assert "kvoffload_free_blocks" in exprs["Blocks by state"]
    assert "kvoffload_policy_parameter" in exprs["Policy parameters"]
    assert "Events missed" in stats
    assert "histogram_quantile" in exprs["Transfer latency"]
    assert "histogram_quantile" in exprs["Engine step time"]
    assert "kvoffload_ghost_hits_total" in exprs["Ghost hits"]
    assert "kvoffload_events_buffered" in exprs["Event backlog"]
