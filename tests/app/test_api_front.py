"""The front process of `kvoffload serve`: cached polling routes, everything
else forwarded, read-your-writes, and the engine process's fate followed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_api_serve import SMALL_ENGINE_FLAGS, TOKEN, free_port, serve, wait_ready

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
READ_TOKEN = "front-read-token"


@pytest.fixture
def front() -> Iterator[tuple[httpx.Client, subprocess.Popen[str]]]:
    port = free_port()
    proc = serve(
        "--port",
        str(port),
        *SMALL_ENGINE_FLAGS,
        "--speed",
        "0",
        env={"KVOFFLOAD_ADMIN_TOKEN": TOKEN, "KVOFFLOAD_READ_TOKEN": READ_TOKEN},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        with httpx.Client(base_url=base, timeout=10.0) as client:
            yield client, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def _engine_pid(front_pid: int) -> int:
    children = [
        int(c)
        for task in Path(f"/proc/{front_pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]
    assert len(children) == 1, children
    return children[0]


@pytest.mark.slow
def test_front_serves_polls_from_a_short_lived_copy_and_reads_its_writes(
    front: tuple[httpx.Client, subprocess.Popen[str]],
) -> None:
    client, _ = front
    read = {"Authorization": f"Bearer {READ_TOKEN}"}
    first = client.get("/v1/cache", headers=read)
    assert first.status_code == 200
    # The engine runs at full speed, so every fresh answer shows a later
    # step: repeated bodies among quick polls come from the copy. (Twenty
    # loopback requests all 50 ms apart would take a machine far slower
    # than any CI.)
    bodies = [client.get("/v1/cache", headers=read).content for _ in range(20)]
    assert len(set(bodies)) < len(bodies)
    time.sleep(0.2)
    later = client.get("/v1/cache", headers=read).json()
    assert later["step"] > first.json()["step"], "the copy must expire"

    switched = client.put("/v1/policy", headers=ADMIN, json={"policy": "arc"})
    assert switched.status_code == 200, switched.text
    # a write empties the copy: the next read shows it at once
    assert client.get("/v1/cache", headers=read).json()["policy"] == "arc"
    assert 'kvoffload_policy_info{policy="arc"} 1.0' in client.get("/metrics", headers=read).text


@pytest.mark.slow
def test_front_leaves_auth_and_validation_to_the_engine_process(
    front: tuple[httpx.Client, subprocess.Popen[str]],
) -> None:
    client, _ = front
    assert client.get("/v1/cache", headers={"Authorization": f"Bearer {READ_TOKEN}"}).is_success
    # a valid copy exists now; bad credentials must still get the real answers
    missing = client.get("/v1/cache")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_token"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    wrong = client.get("/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    unknown = client.get("/v1/cache?verbose=1", headers=ADMIN)
    assert unknown.status_code == 422
    page = client.get("/v1/events", params={"after_seq": 0, "limit": 3}, headers=ADMIN).json()
    assert len(page["events"]) == 3


@pytest.mark.slow
def test_front_stops_when_the_engine_process_dies(
    front: tuple[httpx.Client, subprocess.Popen[str]],
) -> None:
    _, proc = front
    os.kill(_engine_pid(proc.pid), signal.SIGKILL)
    assert proc.wait(30) == 1
