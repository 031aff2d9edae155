"""Each install target works alone, as a user meets it: a fresh virtual
environment, ``pip install`` of this checkout with one extra, then the entry
point of that extra. Nothing from the test environment leaks in, so a module
an entry point imports but its extra does not declare fails here.

Slow (a fresh venv each, torch for the service): about a minute apiece.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
#: the CPU build on CI machines; never a multi-GB CUDA download
TORCH = "torch==2.13.0"

pytestmark = pytest.mark.slow


def _source_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored):
    no .venv, no built extension, no caches."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def _fresh_venv(tmp: Path, *requirements: str) -> Path:
    """A new venv with ``pip install <requirements>``; returns its bin folder."""
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    bin_dir = env_dir / "bin"
    for requirement in requirements:
        done = subprocess.run(
            [str(bin_dir / "python"), "-m", "pip", "install", "-q", requirement],
            capture_output=True,
            text=True,
            env=_clean_env(),
        )
        assert done.returncode == 0, f"pip install {requirement} failed:\n{done.stderr[-4000:]}"
    return bin_dir


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without this venv or any KVOFFLOAD_/OTEL_ setting."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVOFFLOAD_", "OTEL_", "PYTHON", "VIRTUAL_ENV"))
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )
    return {**env, **extra}


def test_core_install_imports_and_replays_in_a_terminal(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    bin_dir = _fresh_venv(tmp_path, str(src))
    probe = (
        "import sys, kvoffload, kvoffload.table as t; "
        "heavy = sorted(m for m in ('torch', 'fastapi', 'prometheus_client', 'opentelemetry', "
        "'pydantic', 'uvicorn') if m in sys.modules); "
        "print(t.IMPLEMENTATION, heavy)"
    )
    done = subprocess.run(
        [str(bin_dir / "python"), "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["c", "[]"]

    # stderr on a pseudo-terminal: the progress bar is drawn (tqdm), stdout
    # still carries the table
    leader, follower = os.openpty()
    received: list[bytes] = []

    def read_terminal() -> None:  # concurrently: a full pty buffer blocks the writer
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO once the last writer is gone
                return
            if not chunk:
                return
            received.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        run = subprocess.run(
            [
                str(bin_dir / "kvoffload"),
                "replay",
                str(TRACE),
                "--policy",
                "lru,kvarc",
                "--capacity",
                "5%",
            ],
            stdout=subprocess.PIPE,
            stderr=follower,
            cwd=tmp_path,
            env=_clean_env(),
            timeout=300,
        )
    finally:
        os.close(follower)
        reader.join(10)
        os.close(leader)
    terminal = b"".join(received)
    assert run.returncode == 0, terminal.decode(errors="replace")
    assert b"req/s" in terminal or b"req]" in terminal, terminal  # tqdm's rate, unit "req"
    table = run.stdout.decode()
    assert "lru" in table and "kvarc" in table and "belady" in table.lower()

    # the service is another extra's: one clear line, no traceback
    serve = subprocess.run(
        [str(bin_dir / "kvoffload"), "serve"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_clean_env(),
    )
    assert serve.returncode == 2
    assert "install kvoffload with the 'app' extra" in serve.stderr
    assert "Traceback" not in serve.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_app_install_serves_until_ready(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    bin_dir = _fresh_venv(tmp_path, TORCH, f"{src}[app]")
    port = _free_port()
    with (tmp_path / "serve.log").open("w+") as log:
        proc = subprocess.Popen(
            [str(bin_dir / "kvoffload"), "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=_clean_env(),
        )
        try:
            status = _wait_ready(f"http://127.0.0.1:{port}", proc)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/cache", timeout=5) as r:
                cache_status = r.status
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        log.seek(0)
        output = log.read()
    assert status == 200, output
    assert cache_status == 200, output
    assert code == 0, output


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> int | None:
    """``/readyz``'s status once it answers 200, or ``None`` if the process
    ended or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                return int(r.status)
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    return None


def test_install_script_passes_the_torch_words_to_pip(tmp_path: Path) -> None:
    """`KVOFFLOAD_TORCH` is what pip is asked for, pip options included (the
    README's CPU index line): here `--dry-run`, so torch is resolved and not
    installed. Quoted as one word, pip would refuse it as a requirement."""
    src = _source_copy(tmp_path / "src")
    done = subprocess.run(
        ["scripts/install", "prometheus"],
        cwd=src,
        capture_output=True,
        text=True,
        env=_clean_env(KVOFFLOAD_TORCH=f"{TORCH} --dry-run"),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    probe = "import importlib.util as u, kvoffload; print(u.find_spec('torch') is None)"
    python = src / ".venv" / "bin" / "python"
    answer = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path
    )
    assert answer.stdout.split() == ["True"], answer.stderr


def test_install_script_skips_pip_when_the_venv_is_current(tmp_path: Path) -> None:
    """A second `scripts/install` (each `scripts/serve` runs one) does nothing
    when the venv was installed from the same dependency lists, C source and
    torch request, with that extra or dev. Here pip is taken out of the venv
    after the first install, so any later pip call fails the run: the second
    run passes only if it skips pip, and the runs after a change must fail."""
    src = _source_copy(tmp_path / "src")
    env = _clean_env(KVOFFLOAD_TORCH="")

    def install(extra: str, **more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["scripts/install", extra], cwd=src, capture_output=True, text=True, env={**env, **more}
        )

    first = install("prometheus")
    assert first.returncode == 0, first.stderr[-4000:]
    site = subprocess.run(
        [
            str(src / ".venv/bin/python"),
            "-c",
            "import pip, os; print(os.path.dirname(pip.__file__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shutil.rmtree(site)

    again = install("prometheus")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "already holds kvoffload[prometheus]" in again.stderr

    assert install("prometheus", KVOFFLOAD_REINSTALL="1").returncode != 0  # asked to
    assert install("otel").returncode != 0  # an extra not installed yet
    assert install("prometheus", KVOFFLOAD_TORCH="torch==2.13.0").returncode != 0
    built = list(src.glob("kvoffload/_table*.so"))
    assert built, "the editable install builds the C table in place"
    for table in built:
        table.rename(table.with_name(table.name + ".aside"))
    assert install("prometheus").returncode != 0  # the C table is gone
    for table in built:
        table.with_name(table.name + ".aside").rename(table)
    assert install("prometheus").returncode == 0
    with (src / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency list\n")
    assert install("prometheus").returncode != 0


@pytest.mark.parametrize("extra", ["app", "dev"])
def test_install_script_as_root_asks_apt_for_the_compiler_whatever_the_extra(
    tmp_path: Path, extra: str
) -> None:
    """README: run as root on Debian or Ubuntu, the scripts install what is
    missing. For the app extra (scripts/serve) a missing compiler was only a
    warning, and the service ran on the pure-Python table, about 3x slower
    (audit). Here root and apt-get are stand-ins on a PATH without gcc: apt-get
    notes what it is asked for and refuses the install, which stops the script
    before anything else happens."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "python3", "dirname", "cat", "grep", "cut", "sha256sum", "mv"):
        found = shutil.which(tool)
        assert found is not None, tool
        (tools / tool).symlink_to(found)
    asked = tmp_path / "apt.log"
    fakes = {"id": "echo 0", "apt-get": f'echo "$*" >> {asked}; [ "$1" = update ]'}
    for name, body in fakes.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    done = subprocess.run(
        [str(REPO / "scripts" / "install"), extra],
        capture_output=True,
        text=True,
        env={**_clean_env(), "PATH": str(tools)},
    )
    assert done.returncode != 0 and asked.exists(), done.stderr  # the fake refused
    calls = asked.read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1].startswith("install -y -qq --no-install-recommends "), calls
    assert {"gcc", "libc6-dev"} <= set(calls[1].split()), calls
    assert "pure-Python block table" not in done.stderr
