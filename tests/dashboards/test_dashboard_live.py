"""Every dashboard query, evaluated by a real Prometheus scraping a live ``kvoffload serve``.

The service starts under LRU and is switched, paused, resumed and reset (see
``live_stack``), so that the annotations have data and the ARC panels must have kvarc's.
A query passes when Prometheus accepts it and returns at least one series: the point
is that it is valid and that the metrics it reads exist (rare events such as missed
events are exported at 0). The annotations must mark each command exactly once.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import yaml
from dashboard_queries import DEPLOY_DIR, METRIC_NAME, PanelQuery, docs_promql_examples, substitute
from live_stack import READ_HEADERS, LiveStack, Sent, get_json
from prometheus_client.parser import text_string_to_metric_families

_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")


def _exposed_series(stack: LiveStack) -> set[str]:
    request = urllib.request.Request(f"{stack.service_url}/metrics", headers=READ_HEADERS)
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }


def test_every_queried_metric_is_exposed_by_the_service(
    live_stack: LiveStack, queries: list[PanelQuery]
) -> None:
    exposed = _exposed_series(live_stack)
    missing = sorted(
        {
            f"{query.where}: {metric}"
            for query in queries
            for metric in METRIC_NAME.findall(query.expr)
            if metric not in exposed
        }
    )
    assert not missing, "\n".join(missing)


def test_every_query_returns_data(live_stack: LiveStack, queries: list[PanelQuery]) -> None:
    variables = live_stack.variables()
    failures = []
    for query in queries:
        expr = substitute(query.expr, variables)
        answer = live_stack.query(expr)
        if answer["status"] != "success":
            failures.append(f"{query.where}: {answer.get('error')}\n    {expr}")
        elif not answer["data"]["result"]:
            failures.append(f"{query.where}: no data\n    {expr}")
    assert not failures, "\n".join(failures)


def test_the_docs_promql_examples_return_data(live_stack: LiveStack) -> None:
    # docs/observability.md's queries, as an operator would paste them (they
    # were only parsed, by promtool)
    exprs = docs_promql_examples()
    assert len(exprs) >= 10
    failures = []
    for expr in exprs:
        answer = live_stack.query(expr)
        # an alert-like filter ("... > 0") is empty on a healthy service: the
        # series under it must have data
        body = re.sub(r"\s*>\s*0$", "", expr)
        data = answer if body == expr else live_stack.query(body)
        if answer["status"] != "success":
            failures.append(f"{answer.get('error')}\n    {expr}")
        elif not data["data"]["result"]:
            failures.append(f"no data\n    {body}")
    assert not failures, "\n".join(failures)


def test_template_variables_list_the_service(
    live_stack: LiveStack, dashboards: dict[str, dict[str, Any]]
) -> None:
    expected = {"job": live_stack.job, "instance": live_stack.instance}
    for name, board in dashboards.items():
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = _LABEL_VALUES.fullmatch(variable["query"])
            assert match, f"{name}: ${variable['name']} is not a label_values() query"
            selector = substitute(match["selector"], live_stack.variables())
            answer = get_json(
                f"{live_stack.prometheus_url}/api/v1/label/{match['label']}/values",
                {"match[]": selector},
            )
            assert answer["status"] == "success", answer
            assert expected[variable["name"]] in answer["data"], (name, variable["name"], answer)


def test_alert_rules_evaluate(live_stack: LiveStack) -> None:
    """The shipped alerts are valid against live data (their thresholds keep them quiet)."""
    rules = yaml.safe_load((DEPLOY_DIR / "prometheus" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            answer = live_stack.query(rule["expr"])
            assert answer["status"] == "success", (rule["alert"], answer)


@dataclass(frozen=True, slots=True, order=True)
class Marker:
    time_ms: int
    end_ms: int
    title: str
    text: str


def _render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)


def grafana_markers(
    annotation: dict[str, Any], series: list[dict[str, Any]], step_ms: int
) -> list[Marker]:
    """The annotation events Grafana's Prometheus data source makes of a range query's
    series: each point with a value > 0 is an event at the point's time, or, with
    ``useValueForTime``, at the time its value names (milliseconds); a series' events
    at most one step apart merge into one, spanning from the first to the last."""
    markers = []
    for one in series:
        labels = one["metric"]
        if annotation.get("useValueForTime"):
            times = [int(float(value)) for _, value in one["values"]]
        else:
            times = [int(float(t) * 1000) for t, value in one["values"] if float(value) > 0]
        open_marker: list[int] = []
        for t in times:
            if open_marker and open_marker[1] + step_ms >= t:
                open_marker[1] = t
                continue
            if open_marker:
                markers.append((open_marker[0], open_marker[1], labels))
            open_marker = [t, t]
        if open_marker:
            markers.append((open_marker[0], open_marker[1], labels))
    return sorted(
        Marker(
            start,
            end,
            _render(annotation.get("titleFormat", ""), labels),
            _render(annotation.get("textFormat", ""), labels),
        )
        for start, end, labels in markers
    )


def test_annotations_mark_each_command_once_when_it_took_effect(
    live_stack: LiveStack, dashboards: dict[str, dict[str, Any]]
) -> None:
    # issue 18: the switch marker (changes(kvoffload_policy_version[1m]) > 0) lasted a
    # minute and named only the new policy; pauses, resumes and resets had none. A
    # step of 1 s (the stack's scrape interval) is the hard case: every step sees it.
    board = dashboards["kvoffload-overview.json"]
    annotations = {a["name"]: a for a in board["annotations"]["list"]}
    variables = live_stack.variables()

    def markers(name: str) -> list[Marker]:
        annotation = annotations[name]
        expr = substitute(annotation["expr"], variables)
        window = {"start": str(live_stack.started - 5), "end": str(time.time()), "step": "1"}
        answer = get_json(
            f"{live_stack.prometheus_url}/api/v1/query_range", {"query": expr, **window}
        )
        assert answer["status"] == "success", (name, answer)
        return grafana_markers(annotation, answer["data"]["result"], step_ms=1000)

    def at_the_time(marker: Marker, sent: Sent) -> bool:
        # a point, within the request that caused it (the value is floored to a ms)
        at = marker.time_ms
        return marker.end_ms == at and int(sent.before * 1000) <= at <= sent.after * 1000

    switches = [c for c in live_stack.commands if c.kind == "switch_policy"]
    found = markers("Policy switches")
    assert len(found) == len(switches) == 5, found
    for marker, sent in zip(found, switches, strict=True):
        assert at_the_time(marker, sent), (marker, sent)
        assert marker.title == "Policy switch"
        expected = f"{live_stack.instance}: {sent.previous_policy} -> {sent.policy}"
        assert marker.text == expected, marker
    others = [c for c in live_stack.commands if c.kind != "switch_policy"]
    found = markers("Pause, resume, reset")
    assert [m.title for m in found] == [c.kind for c in others] == ["pause", "resume", "reset"]
    for marker, sent in zip(found, others, strict=True):
        assert at_the_time(marker, sent), (marker, sent)


def test_exemplars_in_prometheus_lead_to_the_traces_the_service_exported(
    live_stack: LiveStack, dashboards: dict[str, dict[str, Any]]
) -> None:
    # Prometheus scrapes OpenMetrics (it asks for it first), keeps the exemplars
    # of the histogram buckets, and each names a step span the service sent
    # over OTLP: the link a dashboard's exemplar points follow
    def exemplars(histogram: str) -> list[dict[str, Any]]:
        answer = get_json(
            f"{live_stack.prometheus_url}/api/v1/query_exemplars",
            {
                "query": f'{histogram}_bucket{{job="{live_stack.job}"}}',
                "start": str(live_stack.started - 60),
                "end": str(time.time() + 60),
            },
        )
        assert answer["status"] == "success", answer
        return [e for series in answer["data"] for e in series["exemplars"]]

    found = {
        name: exemplars(name)
        for name in (
            "kvoffload_runtime_step_duration_seconds",
            "kvoffload_transfer_duration_seconds",
        )
    }
    for name, items in found.items():
        assert items, f"Prometheus kept no exemplar of {name}"
    named = {e["labels"]["trace_id"] for items in found.values() for e in items}
    deadline = time.monotonic() + 15
    while True:  # the service exports every 0.2 s; the last steps may be on their way
        steps = {
            span.trace_id.hex() for span in live_stack.otlp.spans() if span.name == "kvoffload.step"
        }
        if named <= steps or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert named <= steps, f"{len(named - steps)} exemplars name traces the service never sent"
    # and the dashboard shows them where it says it does
    panels = {
        p["title"]: p for p in dashboards["kvoffload-overview.json"]["panels"] if "targets" in p
    }
    for title in ("Engine step time", "Transfer latency"):
        with_exemplars = [t["legendFormat"] for t in panels[title]["targets"] if t.get("exemplar")]
        assert with_exemplars and all("p99" in legend for legend in with_exemplars), title
