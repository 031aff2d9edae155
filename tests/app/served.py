"""A real `kvoffload serve` subprocess on loopback, for the tests that need the
whole process (its HTTP server, its limits, its memory)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "served-admin-token"
READ_TOKEN = "served-read-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
READ = {"Authorization": f"Bearer {READ_TOKEN}"}

#: a small engine on CPU tensors: quick to start, same code paths
SMALL_ENGINE_FLAGS = (
    "--num-cpu-blocks",
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


def serve(
    *args: str, env: dict[str, str] | None = None, log: IO[str] | None = None
) -> subprocess.Popen[str]:
    """`kvoffload serve ARGS`, its output piped (read it, or the server blocks
    once the pipe is full) or written to ``log``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVOFFLOAD_", "OTEL_"))}
    environ["PYTHONPATH"] = str(ROOT)
    environ.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "serve", *args],
        cwd=ROOT,
        env=environ,
        stdout=log if log is not None else subprocess.PIPE,
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


@dataclass
class Served:
    base: str
    port: int
    proc: subprocess.Popen[str]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@contextlib.contextmanager
def served(
    *flags: str, env: dict[str, str] | None = None, log_path: Path | None = None
) -> Iterator[Served]:
    """`kvoffload serve` with the small engine, both tokens (``env`` may
    override them) and ``flags``, its log in ``log_path`` (default: a
    temporary file); stopped with SIGTERM (killed if it does not stop)."""
    port = free_port()
    tokens = {"KVOFFLOAD_ADMIN_TOKEN": TOKEN, "KVOFFLOAD_READ_TOKEN": READ_TOKEN}
    log = (  # closed in the finally below
        log_path.open("w") if log_path is not None else tempfile.TemporaryFile("w+")  # noqa: SIM115
    )
    proc = serve(
        "--port", str(port), *SMALL_ENGINE_FLAGS, *flags, env={**tokens, **(env or {})}, log=log
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield Served(base, port, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def raw_request(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send ``request`` as it is and return what comes back until the server
    closes the connection or ``timeout`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        return b"".join(chunks)


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response[9:12])
