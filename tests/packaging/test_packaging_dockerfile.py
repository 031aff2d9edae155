"""The Dockerfile, checked by reading it (no Docker engine here; CI also runs hadolint).

Layers go from what changes least to what changes most (torch, then the
dependencies through a stub package, then the source); the service runs as a
non-root user, with a health check on /livez that needs no curl.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order, continuation lines joined, comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


def dockerignore_patterns(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """``(is_exception, regex)`` for each pattern of a .dockerignore, in order."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        glob = line.removeprefix("!").strip().strip("/")
        regex = ""
        for token in re.split(r"(\*\*/?|\*|\?)", glob):
            if token in ("**", "**/"):
                regex += ".*"
            elif token == "*":
                regex += "[^/]*"
            elif token == "?":
                regex += "[^/]"
            else:
                regex += re.escape(token)
        patterns.append((exception, re.compile(regex)))
    return patterns


def is_ignored(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for exception, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not exception
    return ignored


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile((REPO / "Dockerfile").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    return dockerignore_patterns((REPO / ".dockerignore").read_text(encoding="utf-8"))


def _index(instructions: list[Instruction], keyword: str, pattern: str) -> int:
    """Position of the first ``keyword`` instruction whose arguments match ``pattern``."""
    for index, instruction in enumerate(instructions):
        if instruction.keyword == keyword and re.search(pattern, instruction.args):
            return index
    raise AssertionError(f"no {keyword} matching {pattern!r}")


def test_base_image_is_slim_python_311_and_overridable(instructions: list[Instruction]) -> None:
    first, from_ = instructions[0], instructions[1]
    assert first.keyword == "ARG"
    name, _, default = first.args.partition("=")
    assert name == "BASE_IMAGE"
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", default), default
    assert from_.keyword == "FROM" and from_.args == "${BASE_IMAGE}"
    assert [i.keyword for i in instructions].count("FROM") == 1


def test_torch_is_the_cpu_build_by_default(instructions: list[Instruction]) -> None:
    arg = instructions[_index(instructions, "ARG", r"^TORCH_SPEC=")]
    spec = arg.args.partition("=")[2].strip('"')
    assert spec == "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    _index(instructions, "RUN", r"pip install \$\{TORCH_SPEC\}")


def test_dependencies_are_installed_before_the_source_is_copied(
    instructions: list[Instruction],
) -> None:
    torch = _index(instructions, "RUN", r"TORCH_SPEC")
    project = _index(instructions, "COPY", r"^pyproject\.toml ")
    # the image exports OTLP over either protocol (docs/observability.md)
    dependencies = _index(instructions, "RUN", r"pip install \"?\.\[app,otlp-grpc\]")
    source = _index(instructions, "COPY", r"^\. ")
    install = _index(instructions, "RUN", r"pip install --no-deps \.")
    assert torch < project < dependencies < source < install
    # the dependency layer installs a stub, not the source: only pyproject is copied before it
    copies = [i for i in instructions[:source] if i.keyword == "COPY"]
    assert [c.args for c in copies] == [instructions[project].args]


def test_the_service_runs_as_a_non_root_user(instructions: list[Instruction]) -> None:
    users = [i for i, ins in enumerate(instructions) if ins.keyword == "USER"]
    assert users, "no USER: the service would run as root"
    user = instructions[users[-1]].args.split(":")[0]
    assert user not in {"root", "0"}
    runs = [i for i, ins in enumerate(instructions) if ins.keyword == "RUN"]
    assert max(runs) < users[-1] < _index(instructions, "CMD", ".")


def test_healthcheck_probes_livez_with_python(instructions: list[Instruction]) -> None:
    (check,) = [i for i in instructions if i.keyword == "HEALTHCHECK"]
    options, _, command = check.args.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"]
    assert "urllib.request" in argv[2] and "/livez" in argv[2]
    assert not re.search(r"\b(curl|wget)\b", check.args)


def test_serves_on_port_8000_on_all_interfaces(instructions: list[Instruction]) -> None:
    assert instructions[_index(instructions, "EXPOSE", ".")].args == "8000"
    # no flags: they would beat `docker run -e KVOFFLOAD_HOST=...` (flags win
    # over variables), and the command once passed --host
    assert json.loads(instructions[_index(instructions, "CMD", ".")].args) == ["kvoffload", "serve"]
    env = next(i.args for i in instructions if i.keyword == "ENV" and "KVOFFLOAD_PORT" in i.args)
    assert env.split() == ["KVOFFLOAD_HOST=0.0.0.0", "KVOFFLOAD_PORT=8000"]


def test_the_extension_check_imports_the_installed_package(
    instructions: list[Instruction], tmp_path: Path
) -> None:
    """The build's check runs in /src, whose kvoffload/ has no built
    extension: with the working directory first on the import path it found
    that copy and failed every build. Run here as written, in a folder laid
    out as /src, with an installed package beside it (``-S`` keeps this
    environment's editable install, whose finder wins over the path, out)."""
    build = next(
        i.args for i in instructions if i.keyword == "RUN" and "kvoffload._table" in i.args
    )
    check = re.search(r'(python[^&]*"import kvoffload._table, kvoffload.transfer._rows")', build)
    assert check is not None, build
    argv = shlex.split(check.group(1))
    src, site = tmp_path / "src", tmp_path / "site-packages"
    (src / "kvoffload").mkdir(parents=True)
    (src / "kvoffload" / "__init__.py").write_text("")  # the source, unbuilt
    (site / "kvoffload").mkdir(parents=True)
    (site / "kvoffload" / "__init__.py").write_text("")
    (site / "kvoffload" / "_table.py").write_text("")  # the built extensions, installed
    (site / "kvoffload" / "transfer").mkdir()
    (site / "kvoffload" / "transfer" / "__init__.py").write_text("")
    (site / "kvoffload" / "transfer" / "_rows.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(site)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-S", *args],
            cwd=src,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    assert run(*argv[1:]).returncode == 0, run(*argv[1:]).stderr
    assert run("-c", "import kvoffload._table").returncode != 0  # the check as it was
    (site / "kvoffload" / "transfer" / "_rows.py").unlink()  # the row copier not built
    assert run(*argv[1:]).returncode != 0


def test_every_copy_source_exists_in_the_build_context(
    instructions: list[Instruction], ignore_patterns: list[tuple[bool, re.Pattern[str]]]
) -> None:
    for instruction in instructions:
        if instruction.keyword != "COPY":
            continue
        *sources, _destination = [a for a in instruction.args.split() if not a.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file"
            if source != ".":
                assert not is_ignored(source, ignore_patterns), f"COPY {source}: in .dockerignore"


def test_build_context_holds_the_package_and_nothing_else(
    ignore_patterns: list[tuple[bool, re.Pattern[str]]],
) -> None:
    needed = [
        "pyproject.toml",
        "setup.py",
        "kvoffload/_table.c",
        "kvoffload/__init__.py",
        "kvoffload/_version.py",
        "kvoffload/cli.py",
    ]
    needed += [str(p.relative_to(REPO)) for p in (REPO / "app").glob("*.py")]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not is_ignored(path, ignore_patterns), f"{path} is left out of the image"
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "bench/x.py",
        "dashboards/kvoffload-overview.json",
        "kvoffload/__pycache__/cli.cpython-311.pyc",
        "kvoffload/_table.cpython-311-x86_64-linux-gnu.so",  # built here, for another Python
    ]:
        assert is_ignored(path, ignore_patterns), f"{path} would be sent to the build"


def test_dockerignore_matcher_follows_docker_rules() -> None:
    patterns = dockerignore_patterns("*\n!src/\nsrc/**/*.tmp\n")
    assert is_ignored("README.md", patterns)
    assert not is_ignored("src/a.py", patterns)
    assert is_ignored("src/deep/x.tmp", patterns)
    assert is_ignored("other/a.py", patterns)
