"""Fixtures for the dashboard and deployment tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from dashboard_queries import PanelQuery, load_dashboards, panel_queries
from live_stack import LiveStack, running_stack


@pytest.fixture(scope="session")
def dashboards() -> dict[str, dict[str, Any]]:
    """The committed dashboards by file name."""
    boards = load_dashboards()
    assert boards, "no dashboards committed"
    return boards


@pytest.fixture(scope="session")
def queries(dashboards: dict[str, dict[str, Any]]) -> list[PanelQuery]:
    """Every PromQL query of the committed dashboards."""
    found = panel_queries(dashboards)
    assert found
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: apt-get install prometheus (.ci/run installs it)",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    """kvoffload serve (LRU, then switched to ARC) scraped every second by Prometheus."""
    with running_stack(tmp_path_factory.mktemp("live-stack")) as stack:
        yield stack
