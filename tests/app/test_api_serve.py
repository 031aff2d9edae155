"""`kvoffload serve` as operators run it: a real uvicorn process on loopback,
exercised over HTTP, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "serve-test-admin-token"


#: a small engine on CPU tensors: quick to start, same code paths
SMALL_ENGINE_FLAGS = (
    "--capacity",
    "64",
    "--gpu-blocks",
    "64",
    "--head-size",
    "8",
    "--device",
    "cpu",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVOFFLOAD_", "OTEL_"))}
    environ["PYTHONPATH"] = str(ROOT)
    environ.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "serve", *args],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(base: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}"
        )
        try:
            if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server not ready in time")


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
    assert TOKEN not in log


@pytest.mark.slow
def test_serve_refuses_public_host_without_admin_token() -> None:
    proc = serve("--host", "0.0.0.0", "--port", str(free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "refusing to bind '0.0.0.0' without an admin token" in out


@pytest.mark.slow
def test_serve_help_names_env_vars() -> None:
    proc = serve("--help")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    for name in ("--host", "KVOFFLOAD_HOST", "--port", "KVOFFLOAD_PORT", "KVOFFLOAD_ADMIN_TOKEN"):
        assert name in out
