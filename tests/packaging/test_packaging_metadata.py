"""pyproject.toml: extras, the console script, and one place for the version."""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from pathlib import Path
from typing import Any

import pytest

import kvoffload
import kvoffload._version
import kvoffload.cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)
    return data


def test_extras_are_declared(project: dict[str, Any]) -> None:
    extras = project["project"]["optional-dependencies"]
    assert {"torch", "prometheus", "otel", "app", "otlp-grpc", "dev"} <= set(extras)
    # the tests export over both OTLP protocols
    (own,) = [dep for dep in extras["dev"] if dep.startswith("kvoffload[")]
    assert set(own.removeprefix("kvoffload[").removesuffix("]").split(",")) == {"app", "otlp-grpc"}
    assert any("otlp-proto-grpc" in dep for dep in extras["otlp-grpc"])


def test_console_script_is_declared_and_installed(project: dict[str, Any]) -> None:
    assert project["project"]["scripts"]["kvoffload"] == "kvoffload.cli:main"
    (entry_point,) = importlib.metadata.entry_points(group="console_scripts", name="kvoffload")
    assert entry_point.value == "kvoffload.cli:main"
    assert entry_point.load() is kvoffload.cli.main


def test_version_is_defined_once_in_the_version_module(project: dict[str, Any]) -> None:
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "kvoffload._version.__version__"}
    assigned_in = sorted(
        str(path.relative_to(REPO))
        for package in ("kvoffload", "app")
        for path in (REPO / package).rglob("*.py")
        if _assigns_a_version_literal(path)
    )
    assert assigned_in == ["kvoffload/_version.py"]


def test_installed_version_matches_the_source() -> None:
    version = kvoffload._version.__version__
    assert importlib.metadata.version("kvoffload") == version, "reinstall: scripts/install"
    assert getattr(kvoffload, "__version__", version) == version


def test_dashboard_sdk_is_pinned_to_the_installed_release(project: dict[str, Any]) -> None:
    """The committed dashboard JSON is reproducible only with the exact SDK release."""
    (pin,) = [d for d in project["project"]["optional-dependencies"]["dev"] if "grafana" in d]
    name, _, version = pin.partition("==")
    assert name == "grafana-foundation-sdk" and version
    assert importlib.metadata.version(name) == version


def _assigns_a_version_literal(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets)
            if named and isinstance(node.value, ast.Constant):
                return True
    return False


def test_the_license_the_metadata_names_ships_with_the_source(project: dict[str, Any]) -> None:
    # pyproject.toml said Apache-2.0 while no LICENSE file existed
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
