"""Every dashboard query, evaluated by a real Prometheus scraping a live ``kvoffload serve``.

The service starts under LRU and is switched to ARC, then kvarc (see ``live_stack``),
so that the policy-switch annotation has data and the ARC panels must have kvarc's.
A query passes when Prometheus accepts it and returns at least one series: the point
is that it is valid and that the metrics it reads exist (rare events such as drops
are exported at 0).
"""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import yaml
from dashboard_queries import DEPLOY_DIR, METRIC_NAME, PanelQuery, substitute
from live_stack import LiveStack, get_json
from prometheus_client.parser import text_string_to_metric_families

_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")


def _exposed_series(stack: LiveStack) -> set[str]:
    with urllib.request.urlopen(f"{stack.service_url}/metrics", timeout=10) as response:
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
