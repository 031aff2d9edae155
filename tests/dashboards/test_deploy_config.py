"""The deployment files: Prometheus config and alerts, Grafana provisioning, compose.

Docker is not needed: the files are parsed and cross-checked (every mounted path
exists, Grafana loads the directory the dashboards are mounted at, Prometheus scrapes
the compose service on its port).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from dashboard_queries import DASHBOARD_DIR, DEPLOY_DIR, METRIC_NAME, REPO, metric_in_catalogue
from live_stack import EXEMPLAR_STORAGE

PROMETHEUS_CONFIG = DEPLOY_DIR / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY_DIR / "prometheus" / "alerts.yml"
GRAFANA_DATASOURCES = DEPLOY_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARDS = DEPLOY_DIR / "grafana" / "provisioning" / "dashboards" / "kvoffload.yml"
COMPOSE = REPO / "docker-compose.yml"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = _yaml(COMPOSE)
    return data


def _bind_mounts(service: dict[str, Any]) -> dict[PurePosixPath, Path]:
    """Container path -> host path of a service's bind mounts (short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            mounts[PurePosixPath(target)] = (REPO / source).resolve()
    return mounts


def _host_path(mounts: dict[PurePosixPath, Path], container_path: str) -> Path | None:
    """Where a container path lives on the host, if it is under a bind mount."""
    path = PurePosixPath(container_path)
    for target, source in mounts.items():
        if path == target or target in path.parents:
            return source.joinpath(*path.relative_to(target).parts)
    return None


# --- Prometheus ----------------------------------------------------------------------------


def test_promtool_accepts_the_prometheus_config(promtool: str) -> None:
    check = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_read_token_recipe_in_the_prometheus_config_is_valid(
    promtool: str, tmp_path: Path
) -> None:
    """The commented `authorization` block, uncommented as its comment says,
    is a valid scrape config of the kvoffload job (the live dashboard tests
    scrape a service with a read token this way)."""
    text = PROMETHEUS_CONFIG.read_text()
    enabled = re.sub(r"(?m)^(\s*)# (authorization:|  credentials_file: )", r"\1\2", text)
    assert enabled != text, "the recipe is not in the config"
    shutil.copytree(PROMETHEUS_CONFIG.parent, tmp_path / "prometheus")
    config = tmp_path / "prometheus" / "prometheus.yml"
    config.write_text(enabled.replace("/etc/prometheus/", f"{tmp_path / 'prometheus'}/"))
    (tmp_path / "prometheus" / "read-token").write_text("a-read-token")
    check = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    (job,) = yaml.safe_load(enabled)["scrape_configs"]
    assert job["authorization"] == {"credentials_file": "/etc/prometheus/read-token"}


def test_promtool_accepts_the_alert_rules(promtool: str) -> None:
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_alerts_fire_on_what_they_say_and_not_on_a_healthy_service(
    promtool: str, tmp_path: Path
) -> None:
    """promtool's rule tests: an engine that stopped pages, a replay that
    finished does not (kvoffload_runtime_up stays 1); one lost event-log read
    does not fire KVOffloadEventsMissed, a reader that keeps losing does."""
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'kvoffload_runtime_up{instance="stopped"}', "values": "1 0x20"},
                    {"series": 'kvoffload_runtime_up{instance="finished"}', "values": "1x20"},
                    {
                        "series": 'kvoffload_events_missed_total{instance="once"}',
                        "values": "0 6x30",
                    },
                    {
                        "series": 'kvoffload_events_missed_total{instance="always"}',
                        "values": "0+3x30",
                    },
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "5m",
                        "alertname": "KVOffloadEngineStopped",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical", "instance": "stopped"},
                                "exp_annotations": {
                                    "summary": "kvoffload stopped: the engine loop is not running",
                                    "description": "The service answers but its engine has "
                                    "stopped or failed (kvoffload_runtime_up is 0; a replay that "
                                    "finished keeps it at 1).",
                                },
                            }
                        ],
                    },
                    {"eval_time": "4m", "alertname": "KVOffloadEventsMissed", "exp_alerts": []},
                    {
                        "eval_time": "25m",
                        "alertname": "KVOffloadEventsMissed",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "instance": "always"},
                                "exp_annotations": {
                                    "summary": "kvoffload always: an event-log reader is losing "
                                    "events",
                                    "description": "Readers of the event log asked for 15 records "
                                    "in the last 5 minutes that were already overwritten or "
                                    "drained, and have been losing records for 10 minutes: read "
                                    "more often, or enlarge KVOFFLOAD_EVENT_LOG_CAPACITY.",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(tests))
    run = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_alert_rules_read_catalogued_metrics() -> None:
    rules = [rule for group in _yaml(ALERTS)["groups"] for rule in group["rules"]]
    assert rules
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        for metric in METRIC_NAME.findall(rule["expr"]):
            assert metric_in_catalogue(metric), (rule["alert"], metric)


def test_prometheus_scrapes_the_compose_service_every_5s(compose: dict[str, Any]) -> None:
    config = _yaml(PROMETHEUS_CONFIG)
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "kvoffload"]
    assert job.get("scrape_interval", config["global"]["scrape_interval"]) == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for static in job["static_configs"] for t in static["targets"]]
    host, port = target.split(":")
    service = compose["services"][host]
    assert service["environment"]["KVOFFLOAD_PORT"] == port
    for rule_file in config.get("rule_files", []):
        assert (PROMETHEUS_CONFIG.parent / rule_file).is_file(), rule_file


def test_the_compose_prometheus_keeps_exemplars(compose: dict[str, Any]) -> None:
    # the flag the live stack's Prometheus runs with, where the exemplar test
    # follows them to the service's traces
    assert EXEMPLAR_STORAGE in compose["services"]["prometheus"]["command"]


# --- Grafana -------------------------------------------------------------------------------


def test_grafana_datasource_is_the_compose_prometheus(compose: dict[str, Any]) -> None:
    (datasource,) = _yaml(GRAFANA_DATASOURCES)["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["isDefault"] is True
    match = re.fullmatch(r"http://(?P<host>[\w-]+):(?P<port>\d+)", datasource["url"])
    assert match, datasource["url"]
    assert match["host"] in compose["services"]
    assert (
        "--config.file=/etc/prometheus/prometheus.yml"
        in compose["services"]["prometheus"]["command"]
    )
    # $__rate_interval is derived from the scrape interval Grafana is told about
    scrape_interval = _yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval


def test_grafana_loads_the_mounted_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = _bind_mounts(grafana)
    assert _host_path(mounts, "/etc/grafana/provisioning") == GRAFANA_DATASOURCES.parents[1]
    (provider,) = _yaml(GRAFANA_DASHBOARDS)["providers"]
    assert provider["type"] == "file"
    assert _host_path(mounts, provider["options"]["path"]) == DASHBOARD_DIR
    home = _host_path(mounts, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home is not None and home.is_file() and home.parent == DASHBOARD_DIR


# --- compose -------------------------------------------------------------------------------


def test_compose_runs_the_three_services_from_pinned_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"kvoffload", "prometheus", "grafana"}
    assert services["prometheus"]["image"].startswith("prom/prometheus:v")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    for name in ("prometheus", "grafana"):
        tag = services[name]["image"].rpartition(":")[2]
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin an exact version, not {tag!r}"
    build = services["kvoffload"]["build"]
    assert (REPO / build["context"] / build.get("dockerfile", "Dockerfile")).is_file()


def test_compose_bind_mounts_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for target, source in _bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith(("/", ".")):
                assert source in compose.get("volumes", {}), f"{name}: undeclared volume {source}"


def test_compose_exposes_kvoffload_only_with_an_admin_token(compose: dict[str, Any]) -> None:
    environment = compose["services"]["kvoffload"]["environment"]
    assert environment["KVOFFLOAD_HOST"] == "0.0.0.0"
    # required from the caller's environment: no token is written down anywhere
    assert re.fullmatch(r"\$\{KVOFFLOAD_ADMIN_TOKEN:\?.+\}", environment["KVOFFLOAD_ADMIN_TOKEN"])
    for name, service in compose["services"].items():
        for mapping in service.get("ports", []):
            assert mapping.startswith("127.0.0.1:"), f"{name} publishes {mapping} beyond loopback"
