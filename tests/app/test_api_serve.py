"""`kvoffload serve` as operators run it: a real uvicorn process on loopback,
exercised over HTTP, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from served import ROOT, SMALL_ENGINE_FLAGS, free_port, serve, served, wait_ready

TOKEN = "serve-test-admin-token"


@pytest.fixture
def server() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    proc = serve(
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SMALL_ENGINE_FLAGS,
        env={"KVOFFLOAD_ADMIN_TOKEN": TOKEN},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


@pytest.mark.slow
def test_serve_answers_and_stops_cleanly_on_sigterm(
    server: tuple[str, subprocess.Popen[str]],
) -> None:
    base, proc = server
    with httpx.Client(base_url=base, timeout=10.0) as http:
        cache = http.get("/v1/cache")
        assert cache.status_code == 200
        assert cache.json()["blocks"]["capacity"] == 64
        assert http.put("/v1/policy", json={"policy": "arc"}).status_code == 401
        switched = http.put(
            "/v1/policy",
            json={"policy": "arc", "expected_version": 1},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert switched.status_code == 200, switched.text
        assert switched.json()["version"] == 2
        assert http.get("/v1/policy").json()["policy"] == "arc"
        assert "kvoffload_policy_info" in http.get("/metrics").text

    # A live SSE client must not hold up the shutdown.
    got_event = threading.Event()
    stream_ended = threading.Event()

    def tail() -> None:
        with httpx.stream("GET", f"{base}/v1/events/stream", timeout=30.0) as r:
            for line in r.iter_lines():
                if line.startswith("id: "):
                    got_event.set()
        stream_ended.set()

    reader = threading.Thread(target=tail, daemon=True)
    reader.start()
    assert got_event.wait(10), "the stream sent no record"

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert stream_ended.wait(5), "the SSE stream did not end at shutdown"
    assert proc.stdout is not None
    log = proc.stdout.read()
    assert "after finishing in-flight jobs" in log
    assert "no transfer job in flight" in log
    assert "stopped by SIGTERM" in log
    assert "shutdown complete" in log
    assert TOKEN not in log


@pytest.mark.slow
def test_serve_stops_cleanly_on_sigint(server: tuple[str, subprocess.Popen[str]]) -> None:
    # docs/api.md: exit 0 after SIGTERM or SIGINT (Ctrl-C), in-flight jobs
    # finished, telemetry flushed (none to export here)
    base, proc = server
    assert httpx.get(f"{base}/v1/cache", timeout=10.0).status_code == 200
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert proc.stdout is not None
    log = proc.stdout.read()
    assert "stopped by SIGINT" in log
    assert "after finishing in-flight jobs" in log
    assert "shutdown complete" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log


@pytest.mark.slow
def test_serve_warns_about_a_variable_that_is_no_setting(tmp_path: Path) -> None:
    # docs/api.md, Settings: a typo is not ignored in silence; the scripts'
    # own variables are no typo
    log_path = tmp_path / "serve.log"
    env = {
        "KVOFFLOAD_SPEEED": "1",
        "KVOFFLOAD_TORCH": "torch==2.13.0",
        "KVOFFLOAD_PURE_PYTHON": "0",
        "KVOFFLOAD_VLLM_TIER": "skip",
    }
    with served(env=env, log_path=log_path) as s:
        assert httpx.get(f"{s.base}/livez", timeout=5).status_code == 200  # it does start
        log = log_path.read_text()
    warnings = [line for line in log.splitlines() if "warning: KVOFFLOAD_" in line]
    assert warnings == [
        "kvoffload serve: warning: KVOFFLOAD_SPEEED is not a setting and is ignored; "
        "did you mean KVOFFLOAD_SPEED?"
    ], log[-2000:]


@pytest.mark.slow
def test_serve_refuses_public_host_without_admin_token() -> None:
    proc = serve("--host", "0.0.0.0", "--port", str(free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "refusing to bind '0.0.0.0' without an admin token" in out


@pytest.mark.slow
def test_serve_refuses_an_otlp_protocol_it_cannot_export_over() -> None:
    proc = serve(
        "--port",
        str(free_port()),
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
        },
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.splitlines() == [
        "kvoffload serve: error: OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not a protocol "
        "kvoffload exports traces over: use 'http/protobuf' (the default; a collector's "
        "OTLP/HTTP port, usually 4318) or 'grpc' (its OTLP/gRPC port, usually 4317)"
    ], out


@pytest.mark.slow
def test_serve_help_names_env_vars() -> None:
    proc = serve("--help")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    for name in ("--host", "KVOFFLOAD_HOST", "--port", "KVOFFLOAD_PORT", "KVOFFLOAD_ADMIN_TOKEN"):
        assert name in out


@pytest.mark.parametrize(
    "command",
    [
        # docs/api.md's other ways to start the service
        lambda port: [sys.executable, "-m", "app", "--port", str(port), *SMALL_ENGINE_FLAGS],
        lambda port: [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "app.main:create_app",
            "--port",
            str(port),
        ],
    ],
    ids=["python -m app", "uvicorn --factory"],
)
def test_the_other_start_ups_serve(command: Callable[[int], list[str]]) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVOFFLOAD_", "OTEL_"))}
    env.update(PYTHONPATH=str(ROOT), KVOFFLOAD_DEVICE="cpu", KVOFFLOAD_NUM_CPU_BLOCKS="64")
    proc = subprocess.Popen(
        command(port), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        assert httpx.get(f"{base}/v1/policy").json()["policy"] == "lru"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn re-raises the signal once it has shut down cleanly
    clean = proc.returncode == 0 or (
        proc.returncode == -signal.SIGTERM and "Application shutdown complete." in out
    )
    assert clean, out[-2000:]
