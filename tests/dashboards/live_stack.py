"""A running ``kvoffload serve`` scraped every second by a real Prometheus.

:func:`running_stack` starts the service on a free loopback port under LRU, starts
Prometheus (the ``prometheus`` binary) on another with a temporary TSDB, waits for a
few scrapes, and then through the admin API switches the service to ARC and to kvarc,
pauses, resumes and resets it, switches it to LRU and back to kvarc, and last to hkvarc
(so that every kind of command is marked, the ARC panels must show the other policies of
the ARC family, and the foresight panels hkvarc's lists and decisions), waiting for a
few scrapes after each. :attr:`LiveStack.commands` says
what was sent and when. The service exports its traces over OTLP to a receiver in this
process (:attr:`LiveStack.otlp`), and Prometheus keeps exemplars
(``--enable-feature=exemplar-storage``, as in docker-compose.yml), so that the step and
transfer histograms' exemplars can be followed to the traces they name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import GRAFANA_BUILTINS


def _otlp_receiver_module() -> Any:
    # the instrumentation tests' OTLP receiver, by path: this directory is no
    # package, so tests/ is not on the import path here
    path = Path(__file__).resolve().parents[1] / "instrumentation" / "otlp_receiver.py"
    spec = importlib.util.spec_from_file_location("kvoffload_tests_otlp_receiver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


otlp_receiver = _otlp_receiver_module()

ADMIN_TOKEN = "dashboard-test-admin-token"
#: reads closed, as an operator who sets KVOFFLOAD_READ_TOKEN has them: Prometheus
#: scrapes with it the way deploy/prometheus/prometheus.yml says (credentials_file)
READ_TOKEN = "dashboard-test-read-token"
READ_HEADERS = {"Authorization": f"Bearer {READ_TOKEN}"}
JOB = "kvoffload-dashboard-test"
#: the Prometheus flag that keeps exemplars (docker-compose.yml passes it too)
EXEMPLAR_STORAGE = "--enable-feature=exemplar-storage"


@dataclass(frozen=True, slots=True)
class Sent:
    """A command sent to the service: what, and the wall-clock times (Unix seconds)
    just before the request and just after its answer."""

    kind: str
    before: float
    after: float
    #: for a policy switch: the policies it switched from and to
    previous_policy: str = ""
    policy: str = ""


@dataclass(frozen=True, slots=True)
class LiveStack:
    service_url: str
    prometheus_url: str
    job: str
    #: host:port, as Prometheus labels the target
    instance: str
    #: Unix seconds when the service was ready, before any command
    started: float
    commands: tuple[Sent, ...]
    #: what the service exported over OTLP (an ``otlp_receiver.Receiver``)
    otlp: Any = None

    def variables(self) -> dict[str, str]:
        """Dashboard variables selecting this service, as Grafana would send them."""
        # one value, used as a regex: its dots match themselves too
        return {**GRAFANA_BUILTINS, "job": self.job, "instance": self.instance}

    def query(self, expr: str) -> dict[str, Any]:
        """Evaluate ``expr`` now through Prometheus's HTTP API; return the whole answer."""
        return get_json(f"{self.prometheus_url}/api/v1/query", {"query": expr})

    def scrapes_since(self, since: float) -> int:
        """Scrapes of the service Prometheus stored since ``since`` (Unix seconds, to the
        second below)."""
        window = max(1, int(time.time() - since))
        answer = self.query(f'count_over_time(kvoffload_build_info{{job="{self.job}"}}[{window}s])')
        result = answer["data"]["result"] if answer["status"] == "success" else []
        return min((int(float(r["value"][1])) for r in result), default=0)

    def samples(self, selector: str) -> int:
        """Fewest samples any series of ``selector`` has over the last minute (0 if none)."""
        answer = self.query(f"count_over_time({selector}[1m])")
        result = answer["data"]["result"] if answer["status"] == "success" else []
        return min((int(float(r["value"][1])) for r in result), default=0)


def get_json(url: str, params: dict[str, str] | None = None) -> dict[str, Any]:
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            result: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as exc:  # Prometheus explains a bad query in the body
        result = json.load(exc)
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _wait_for(what: str, ready: Callable[[], bool], timeout: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout:.0f}s waiting for {what}\n{why()}", pytrace=False
            )
        time.sleep(0.25)


class _Process:
    """A child process serving HTTP at ``url``, writing to a log file."""

    def __init__(
        self, name: str, url: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.url = url
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited with {self.popen.returncode}"
        tail = self.log.read_text(encoding="utf-8", errors="replace")[-4000:]
        return f"--- {self.name} ({state}), last output:\n{tail}"

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _start_service(workdir: Path, otlp_url: str) -> _Process:
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        # traces only, at the default sampling (1% of steps), exported every 0.2 s
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_url,
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "KVOFFLOAD_ADMIN_TOKEN": ADMIN_TOKEN,
        "KVOFFLOAD_POLICY": "lru",
        # a small tier fills within seconds, so that evictions and ghost hits happen
        "KVOFFLOAD_NUM_CPU_BLOCKS": "96",
        "KVOFFLOAD_DEVICE": "cpu",
        "KVOFFLOAD_SPEED": "0",  # full speed: every panel has data within seconds
    }
    env["KVOFFLOAD_READ_TOKEN"] = READ_TOKEN
    code = "import sys; from kvoffload.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "serve", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    return _Process("kvoffload serve", url, argv, workdir / "kvoffload.log", env)


def _start_prometheus(workdir: Path, target: str) -> _Process:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "the prometheus binary is not installed: apt-get install prometheus"
            " (.ci/run installs it)",
            pytrace=False,
        )
    config = workdir / "prometheus.yml"
    token = workdir / "read-token"
    token.write_text(READ_TOKEN)
    scrape = {
        "job_name": JOB,
        "static_configs": [{"targets": [target]}],
        "authorization": {"credentials_file": str(token)},
    }
    global_ = {"scrape_interval": "1s", "scrape_timeout": "1s"}
    config.write_text(json.dumps({"global": global_, "scrape_configs": [scrape]}))  # JSON is YAML
    port = _free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        EXEMPLAR_STORAGE,
    ]
    url = f"http://127.0.0.1:{port}"
    return _Process("prometheus", url, argv, workdir / "prometheus.log")


def send(service_url: str, kind: str, policy: str = "") -> Sent:
    """Send one admin command (``switch_policy`` to ``policy``, ``pause``, ``resume``,
    ``reset``) and say when."""
    method, path, body = {
        "switch_policy": ("PUT", "/v1/policy", {"policy": policy}),
        "pause": ("POST", "/v1/runtime:pause", None),
        "resume": ("POST", "/v1/runtime:resume", None),
        "reset": ("POST", "/v1/cache:reset", {"confirm": True}),
    }[kind]
    request = urllib.request.Request(
        f"{service_url}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
    )
    before = time.time()
    with urllib.request.urlopen(request, timeout=15) as response:
        assert response.status == 200, response.read()
        answer = json.load(response)
    after = time.time()
    if kind == "switch_policy":
        return Sent(kind, before, after, answer["previous_policy"], answer["policy"])
    return Sent(kind, before, after)


def _refused(service_url: str) -> None:
    """A policy switch without the admin token, answered 401."""
    request = urllib.request.Request(
        f"{service_url}/v1/policy",
        data=b'{"policy": "arc"}',
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request, timeout=15).close()
    except urllib.error.HTTPError as e:
        assert e.code == 401, e.read()
    else:
        raise AssertionError("a switch without the admin token was accepted")


#: what the stack sends, in order, with the scrapes to wait for after each
SCRIPT: tuple[tuple[str, str, int], ...] = (
    ("switch_policy", "arc", 4),
    ("switch_policy", "kvarc", 4),
    ("pause", "", 3),
    ("resume", "", 3),
    ("reset", "", 3),
    ("switch_policy", "lru", 3),
    ("switch_policy", "kvarc", 4),
    ("switch_policy", "hkvarc", 4),
)


@contextmanager
def running_stack(workdir: Path) -> Iterator[LiveStack]:
    with ExitStack() as cleanup:
        otlp = cleanup.enter_context(otlp_receiver.running_receiver())
        service = _start_service(workdir, otlp.url)
        cleanup.callback(service.stop)
        _wait_for(
            "kvoffload serve to be ready",
            lambda: not service.alive() or _status(f"{service.url}/readyz") == 200,
            60,
            service.describe,
        )
        if not service.alive():
            pytest.fail(f"kvoffload serve did not start\n{service.describe()}", pytrace=False)
        instance = service.url.removeprefix("http://")

        prometheus = _start_prometheus(workdir, instance)
        cleanup.callback(prometheus.stop)
        _wait_for(
            "Prometheus to be ready",
            lambda: not prometheus.alive() or _status(f"{prometheus.url}/-/ready") == 200,
            60,
            prometheus.describe,
        )
        if not prometheus.alive():
            pytest.fail(f"Prometheus did not start\n{prometheus.describe()}", pytrace=False)

        started = time.time()
        stack = LiveStack(service.url, prometheus.url, JOB, instance, started, ())
        scope = f'{{job="{JOB}"}}'

        def why() -> str:
            targets = json.dumps(get_json(f"{prometheus.url}/api/v1/targets")["data"], indent=1)
            return f"targets: {targets}\n{service.describe()}\n{prometheus.describe()}"

        _wait_for(
            "3 scrapes under LRU",
            lambda: stack.samples(f"kvoffload_build_info{scope}") >= 3,
            45,
            why,
        )
        # a client without the token: the admin API's refusals have data
        _refused(stack.service_url)
        sent = []
        for kind, policy, scrapes in SCRIPT:
            sent.append(send(stack.service_url, kind, policy))
            after = sent[-1].after
            _wait_for(
                f"{scrapes} scrapes after {kind} {policy}",
                lambda after=after, scrapes=scrapes: stack.scrapes_since(after) >= scrapes,
                45,
                why,
            )
        yield LiveStack(service.url, prometheus.url, JOB, instance, started, tuple(sent), otlp)
