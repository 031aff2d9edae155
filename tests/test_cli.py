"""The ``kvoffload`` command line: replay output, errors, and the serve hand-over."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from kvoffload._version import __version__
from kvoffload.cli import main
from kvoffload.policies import available_policies
from kvoffload.replay import ReplayTrace, parse_capacity, replay
from kvoffload.runtime.trace import DEFAULT_TRACE_BLOCK_SIZE, load_mooncake_trace
from kvoffload.table import IMPLEMENTATION

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "data" / "traces"
CONVERSATION = str(TRACES / "mooncake_conversation_trace.jsonl")
SYNTHETIC = str(TRACES / "mooncake_synthetic_trace.jsonl")


def kvoffload(
    *args: str, path: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a separate process, as a user would (with ``path`` on
    its PYTHONPATH, ``stdin`` as its input)."""
    env = None if path is None else {**os.environ, "PYTHONPATH": str(path)}
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
        env=env,
        input=stdin,
    )


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse exits on usage errors and --help
        status = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_replay_prints_a_table() -> None:
    done = kvoffload(
        "replay", CONVERSATION, SYNTHETIC, "--policy", "lru,arc", "--capacity", "5%,100",
        "--limit", "400",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress bar when stderr is not a terminal
    header, *rows = done.stdout.splitlines()
    assert header.split() == [
        "trace", "policy", "capacity", "cap", "%", "prefix", "hit", "belady", "hit",
        "bypass", "hit", "block", "ops/s", "evictions", "lookahead",
    ]  # fmt: skip
    assert len(rows) == 2 * 2 * 2
    first = rows[0].split()
    assert first[:3] == ["mooncake_conversation_trace.jsonl", "lru", first[2]]
    assert [r.split()[1] for r in rows[:4]] == ["lru", "arc", "lru", "arc"]
    assert [r.split()[2] for r in rows[:4]][2:] == ["100", "100"]
    for row in rows:
        prefix, belady = float(row.split()[4]), float(row.split()[5])
        assert 0.0 <= prefix <= belady <= 1.0
        assert row.split()[6] == "-"  # no hints, no declined stores: no bypass bound


def test_cli_version_names_the_block_table() -> None:
    done = kvoffload("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvoffload {__version__} (block table: {IMPLEMENTATION})\n"


def test_cli_replay_json_has_every_field() -> None:
    done = kvoffload("replay", SYNTHETIC, "--capacity", "10%", "--limit", "500", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    # throughput depends on the block table: the document says which ran
    assert document["block_table"] == IMPLEMENTATION
    (trace,) = document["traces"]
    assert trace["trace"] == "mooncake_synthetic_trace.jsonl"
    assert trace["requests"] == 500
    assert trace["capacities"] == [trace["unique_blocks"] // 10]
    runs = document["runs"]
    assert [run["policy"] for run in runs] == list(available_policies())  # default: all
    for run in runs:
        assert set(run) == {
            "trace", "policy", "capacity_blocks", "capacity_percent", "requests",
            "block_accesses", "hit_blocks", "prefix_hit_ratio", "belady_hit_blocks",
            "belady_hit_ratio", "belady_bypass_hit_blocks", "belady_bypass_hit_ratio",
            "evictions", "rejected_stores", "block_ops", "block_ops_per_second",
            "wall_seconds", "lookahead",
        }  # fmt: skip
        assert run["belady_bypass_hit_blocks"] is run["belady_bypass_hit_ratio"] is None
        assert run["capacity_blocks"] == trace["capacities"][0]
        assert run["prefix_hit_ratio"] == run["hit_blocks"] / run["block_accesses"]
        assert run["hit_blocks"] <= run["belady_hit_blocks"]
        assert run["block_ops"] > 0 and run["wall_seconds"] > 0


def test_cli_replay_table_cells_are_the_json_values_as_documented() -> None:
    # docs/replay.md: decimals, separators, alignment, cap % past 100
    args = [
        "replay", SYNTHETIC, "--policy", "lru,kvarc", "--capacity", "10,100000", "--limit", "300",
    ]  # fmt: skip
    runs = json.loads(kvoffload(*args, "--json").stdout)["runs"]
    table = kvoffload(*args).stdout.splitlines()
    header, rows = table[0], table[1:]
    assert len(rows) == len(runs) == 4
    # text cells start where their column's header does, numbers end where it does
    spans = [m.span() for m in re.finditer(r"\S+(?: \S+)*", header)]
    for row, run in zip(rows, runs, strict=True):
        cells = re.split(r" {2,}", row)
        assert len(cells) == len(spans)
        for i, (cell, (start, end)) in enumerate(zip(cells, spans, strict=True)):
            assert row[start:].startswith(cell) if i < 2 else row[:end].endswith(cell), (i, row)
        assert cells[:2] == [run["trace"], run["policy"]]
        assert cells[2] == str(run["capacity_blocks"])
        assert cells[3] == f"{run['capacity_percent']:.2f}"
        assert cells[4] == f"{run['prefix_hit_ratio']:.4f}"
        assert cells[5] == f"{run['belady_hit_ratio']:.4f}"
        assert re.fullmatch(r"\d{1,3}(,\d{3})*", cells[7])
        assert cells[8] == str(run["evictions"])
    unique = json.loads(kvoffload(*args, "--json").stdout)["traces"][0]["unique_blocks"]
    big = [run for run in runs if run["capacity_blocks"] == 100000]
    assert all(run["capacity_percent"] == 100 * 100000 / unique > 100 for run in big)


def test_cli_replay_json_values_are_what_they_are_documented_to_be() -> None:
    done = kvoffload("replay", SYNTHETIC, "--policy", "lru", "--capacity", "10", "--json")
    document = json.loads(done.stdout)
    assert document["kvoffload_version"] == __version__
    (trace,) = document["traces"]
    # the whole shipped trace (its README's figures)
    assert (trace["requests"], trace["block_accesses"], trace["unique_blocks"]) == (
        3993,
        121877,
        43924,
    )
    (run,) = document["runs"]
    assert run["block_ops_per_second"] == run["block_ops"] / run["wall_seconds"]
    direct = replay(
        ReplayTrace.from_requests(
            load_mooncake_trace(SYNTHETIC), name="t", trace_block_size=DEFAULT_TRACE_BLOCK_SIZE
        ),
        policy="lru",
        capacity=10,
    )
    assert (run["evictions"], run["rejected_stores"], run["hit_blocks"]) == (
        direct.evictions,
        direct.rejected_stores,
        direct.hit_blocks,
    )


def test_cli_trace_block_size_is_a_label_only() -> None:
    # docs/replay.md: the replay counts blocks, whatever their size in tokens
    def runs(size: str) -> list[dict[str, object]]:
        done = kvoffload(
            "replay", SYNTHETIC, "--policy", "lru,hkvarc", "--capacity", "1%", "--limit", "400",
            "--lookahead", "4", "--trace-block-size", size, "--json",
        )  # fmt: skip
        document = json.loads(done.stdout)
        assert document["traces"][0]["trace_block_size"] == int(size)
        timed = ("wall_seconds", "block_ops_per_second")
        return [{k: v for k, v in run.items() if k not in timed} for run in document["runs"]]

    assert runs("16") == runs("512")


def test_cli_replay_defaults_compare_every_policy_on_each_trace_at_four_capacities() -> None:
    # issue 8: kvarc against LRU, ARC and Belady on both traces at 1/5/10/25%,
    # with nothing but the traces on the command line
    assert {"lru", "arc", "kvarc"} <= set(available_policies())
    done = kvoffload("replay", CONVERSATION, SYNTHETIC, "--limit", "1000", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    traces = {t["trace"]: t for t in document["traces"]}
    assert list(traces) == [Path(CONVERSATION).name, Path(SYNTHETIC).name]
    for trace in traces.values():
        unique = trace["unique_blocks"]
        assert trace["capacities"] == [parse_capacity(f"{p}%", unique) for p in (1, 5, 10, 25)]
    runs = [(r["trace"], r["capacity_blocks"], r["policy"]) for r in document["runs"]]
    assert runs == [
        (name, capacity, policy)
        for name, trace in traces.items()
        for capacity in trace["capacities"]
        for policy in available_policies()
    ]
    for run in document["runs"]:
        assert run["hit_blocks"] <= run["belady_hit_blocks"]


def test_cli_replay_lookahead_hints_the_queue_and_only_hkvarc_uses_it() -> None:
    ratios: dict[tuple[str, int], float] = {}
    for lookahead in (0, 64):
        done = kvoffload(
            "replay", SYNTHETIC, "--capacity", "5%", "--limit", "1500", "--json",
            "--lookahead", str(lookahead),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        for run in json.loads(done.stdout)["runs"]:
            assert run["lookahead"] == lookahead
            ratios[run["policy"], lookahead] = run["prefix_hit_ratio"]
    for policy in available_policies():
        if policy != "hkvarc":  # the others ignore hints: the same hits at every W
            assert ratios[policy, 64] == ratios[policy, 0], policy
    assert ratios["hkvarc", 0] == ratios["kvarc", 0]
    assert ratios["hkvarc", 64] > ratios["kvarc", 64] + 0.01


def test_cli_replay_compares_several_windows_in_one_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the runs of "--lookahead 0,16 --lookahead 64" are those of one window
    # at a time, in (capacity, window, policy) order; bypass only where hinted
    common = ["replay", SYNTHETIC, "--capacity", "1%,5%", "--limit", "600", "--json"]
    common += ["--policy", "lru,hkvarc"]
    status, out, err = run_main([*common, "--lookahead", "0,16", "--lookahead", "64"], capsys)
    assert status == 0, err
    runs = json.loads(out)["runs"]
    key = ("capacity_blocks", "lookahead", "policy")
    assert [tuple(r[k] for k in key) for r in runs] == [
        (capacity, w, policy)
        for capacity in json.loads(out)["traces"][0]["capacities"]
        for w in (0, 16, 64)
        for policy in ("lru", "hkvarc")
    ]
    alone = []
    for w in ("0", "16", "64"):
        status, out, err = run_main([*common, "--lookahead", w], capsys)
        assert status == 0, err
        alone += json.loads(out)["runs"]
    timed = ("wall_seconds", "block_ops_per_second")

    def by_run(rs: list[dict[str, object]]) -> dict[tuple[object, ...], dict[str, object]]:
        return {tuple(r[k] for k in key): {k: r[k] for k in r if k not in timed} for r in rs}

    assert by_run(runs) == by_run(alone)
    for r in runs:
        assert (r["belady_bypass_hit_ratio"] is None) == (r["lookahead"] == 0)


def test_cli_replay_with_hints_bounds_declined_stores_by_belady_with_bypass() -> None:
    # hkvarc declines stores with hints: at 1% of the synthetic trace it beats
    # Belady as the replay stores (everything), and stays under Belady with bypass
    done = kvoffload(
        "replay", SYNTHETIC, "--capacity", "1%", "--policy", "kvarc,hkvarc", "--lookahead",
        "128", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = {run["policy"]: run for run in json.loads(done.stdout)["runs"]}
    hk = runs["hkvarc"]
    assert hk["belady_hit_blocks"] < hk["hit_blocks"] <= hk["belady_bypass_hit_blocks"]
    # as docs/policies.md and kvoffload/replay.py quote them (it once said .1645)
    quoted = (hk["belady_hit_ratio"], hk["prefix_hit_ratio"], hk["belady_bypass_hit_ratio"])
    assert [round(r, 4) for r in quoted] == [0.1593, 0.1668, 0.1854]
    assert runs["kvarc"]["hit_blocks"] <= runs["kvarc"]["belady_hit_blocks"]
    table = kvoffload(
        "replay", SYNTHETIC, "--capacity", "1%", "--policy", "hkvarc", "--lookahead", "128"
    )
    row = table.stdout.splitlines()[1].split()
    assert float(row[6]) == round(hk["belady_bypass_hit_ratio"], 4)


def test_cli_errors_exit_2_with_one_line() -> None:
    done = kvoffload("replay", "missing.jsonl")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == "kvoffload replay: error: trace file not found: missing.jsonl\n"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["replay", SYNTHETIC, "--capacity", "abc"], "neither a block count"),
        (["replay", SYNTHETIC, "--capacity", "150%"], "capacity '150%' must be at most 100%"),
        (["replay", SYNTHETIC, "--capacity", "0"], "at least 1 block"),
        (["replay", SYNTHETIC, "--capacity=-5%"], "must be positive"),
        (["replay", SYNTHETIC, "--capacity", "5%,,10%"], "empty item in capacity list"),
        (
            ["replay", SYNTHETIC, "--policy", "lfu"],
            f"unknown policy 'lfu'; valid policies: {', '.join(available_policies())}",
        ),
        (["replay", SYNTHETIC, "--limit", "0"], "argument --limit: expected a positive integer"),
        # int() takes these; only plain ASCII digits are a count
        (["replay", SYNTHETIC, "--limit", "+5"], "argument --limit: expected a positive integer"),
        (
            ["replay", SYNTHETIC, "--lookahead", "+3"],
            "argument --lookahead: expected a number of requests to hint ahead in plain digits, "
            "0 to 9223372036854775807, got '+3'",
        ),
        (["replay", SYNTHETIC, "--lookahead", "1_000"], "in plain digits, 0 to"),
        (["replay", SYNTHETIC, "--lookahead", "\uff13"], "in plain digits, 0 to"),  # fullwidth 3
        (["replay", SYNTHETIC, "--lookahead", "\u0663"], "in plain digits, 0 to"),  # Arabic 3
        (["replay", SYNTHETIC, "--lookahead", " 3"], "in plain digits, 0 to"),
        (["replay", SYNTHETIC, "--lookahead", "9223372036854775808"], "in plain digits, 0 to"),
        # once a traceback: ValueError (int()'s 4300 digits), struct.error (past 2**64)
        (["replay", SYNTHETIC, "--capacity", "1" * 5000], "(5000 characters) must be at most"),
        (
            ["replay", SYNTHETIC, "--capacity", "9223372036854775808"],
            "capacity '9223372036854775808' must be at most 9223372036854775807 blocks",
        ),
        (["replay", SYNTHETIC, "--capacity", "0." + "0" * 5000 + "1%"], "less than one block"),
        (
            ["replay", SYNTHETIC, "--trace-block-size", "99999999999999999999"],
            "argument --trace-block-size: expected a positive integer in plain digits, "
            "1 to 9223372036854775807, got '99999999999999999999'",
        ),
        (["replay", SYNTHETIC, "--trace-block-size", "9" * 5000], "(5000 characters)"),
        (
            ["replay", SYNTHETIC, "--policy", "lru,arc", "--policy", "LRU"],
            "policy 'lru' is named twice; name each policy once",
        ),
        (["replay", SYNTHETIC, SYNTHETIC], f"trace {SYNTHETIC} is given twice"),
        (
            ["replay", SYNTHETIC, "--import", "no_such_module_xyz"],
            "cannot import 'no_such_module_xyz': ModuleNotFoundError",
        ),
        (["replay", SYNTHETIC, "--trace-block-size", "x"], "--trace-block-size"),
        (
            ["replay", SYNTHETIC, "--lookahead", "-8"],
            "argument --lookahead: expected a number of requests to hint ahead in plain digits, "
            "0 to 9223372036854775807, got '-8'",
        ),
        (["replay", SYNTHETIC, "--lookahead", "many"], "argument --lookahead: expected"),
        (["replay", SYNTHETIC, "--lookahead", "0,+3"], "got '+3' in '0,+3'"),
        (["replay", SYNTHETIC, "--lookahead", "0, 8"], "got ' 8' in '0, 8'"),
        (["replay", SYNTHETIC, "--lookahead", "0,,8"], "got an empty item in '0,,8'"),
        (
            ["replay", SYNTHETIC, "--lookahead", "8,32", "--lookahead", "8"],
            "lookahead 8 is given twice; give each window once",
        ),
        (["replay", SYNTHETIC, "--bogus"], "kvoffload replay: error: unrecognized arguments"),
        (["replay"], "the following arguments are required: TRACE"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "kvoffload: error: the following arguments are required: COMMAND"),
    ],
)
def test_cli_bad_arguments_give_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_main(args, capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1
    assert expected in err


def test_cli_an_import_that_exits_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the command exited with the module's status, saying nothing
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, out, err = run_main(["replay", SYNTHETIC, "--import", "exits_on_import"], capsys)
    assert (status, out) == (2, "")
    assert "cannot import 'exits_on_import': it called sys.exit(3) while being imported" in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "no requests (the file is empty or only blank lines)"),
        ("\n  \n\n", "no requests (the file is empty or only blank lines)"),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}\n',
            "no blocks to replay (every request's hash_ids is empty)",
        ),
    ],
)
def test_cli_a_trace_with_nothing_to_replay_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    # once "capacity '1%' of 0 unique blocks is less than one block", or with
    # a block count a table of zeros and status 0
    trace = tmp_path / "t.jsonl"
    trace.write_text(content)
    for capacity in ([], ["--capacity", "10"]):
        status, out, err = run_main(["replay", str(trace), *capacity], capsys)
        assert (status, out) == (2, "")
        assert err == f"kvoffload replay: error: {trace}: {expected}\n"


def test_cli_a_directory_is_not_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_main(["replay", str(tmp_path)], capsys)
    assert status == 2
    assert err == f"kvoffload replay: error: trace path is a directory, not a file: {tmp_path}\n"


def test_cli_import_of_a_module_not_on_the_path_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_main(["replay", SYNTHETIC, "--import", "no_such_module_xyz"], capsys)
    assert status == 2 and "PYTHONPATH=. for the current folder" in err


def test_cli_stops_quietly_when_its_reader_goes_away() -> None:
    # `kvoffload replay ... | head -1`: once a BrokenPipeError traceback
    proc = subprocess.Popen(
        # the answer is flushed as it is written: a small one meets the closed pipe too
        [sys.executable, "-m", "kvoffload.cli", "replay", SYNTHETIC, "--json", "--limit", "300",
         "--policy", "lru", "--capacity", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the answer is written
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(120) == 141, err
    assert err == ""


def test_cli_ctrl_c_is_one_line_and_status_130() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "replay", SYNTHETIC, CONVERSATION],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True,
    )  # fmt: skip
    time.sleep(3)  # loaded, replaying
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert (out, err) == ("", "\nkvoffload replay: interrupted\n")


def test_cli_malformed_trace_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n')
    status, out, err = run_main(["replay", str(trace)], capsys)
    assert (status, out) == (2, "")
    assert err == f"kvoffload replay: error: {trace}: line 1: missing field 'hash_ids'\n"


def test_cli_help_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    done = kvoffload("replay", "--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: kvoffload replay")
    assert "--capacity" in done.stdout and "--trace-block-size" in done.stdout
    status, out, _ = run_main(["--help"], capsys)
    assert status == 0
    assert out.startswith("usage: kvoffload") and "replay" in out and "serve" in out


def test_cli_serve_without_the_service_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "app", None)  # makes "import app.main" fail
    status, out, err = run_main(["serve", "--port", "9000"], capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1
    assert "kvoffload serve: error: the service is not installed" in err
    status, out, err = run_main(["serve", "--help"], capsys)
    assert status == 0 and out.startswith("usage: kvoffload serve") and err == ""


def test_cli_serve_hands_its_arguments_to_the_service(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[list[str]] = []
    app = types.ModuleType("app")
    app_main = types.ModuleType("app.main")

    def run(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    app_main.run = run  # type: ignore[attr-defined]
    app.main = app_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "app", app)
    monkeypatch.setitem(sys.modules, "app.main", app_main)
    status, _, _ = run_main(["serve", "--port", "9000", "--help"], capsys)
    assert status == 3
    assert seen == [["--port", "9000", "--help"]]  # the service parses its own flags


# --------------------------------------------------------------------------- policies of one's own

POLICIES = """
from enum import IntEnum

from kvoffload.policies import EvictionPolicy, register_policy


class L(IntEnum):
    A = 0


class Works(EvictionPolicy):
    name = "works"
    lists = L

    def insert(self, hs, handles):
        self.table.insert(hs, handles, L.A)

    def evict(self, n, protected):
        return self.evict_from(L.A, n, protected)


class Explodes(Works):
    def evict(self, n, protected):
        raise RuntimeError("evict\\nexploded")  # one line on stderr all the same


class Unbuildable(Works):
    def __init__(self):
        pass


class AlsoExplodes(Works):
    def touch(self, hs):
        raise ValueError("touch broke")


class Repeats(Works):
    name = "repeats"

    def evict(self, n, protected):
        victims = self.evict_from(L.A, n, protected)
        if victims is None:
            return None
        hashes, handles = victims
        return [*hashes[:-1], hashes[0]], handles  # one victim twice


class BigOnly(Works):
    def __init__(self, capacity, table):
        if capacity > 15:
            raise MemoryError(f"{capacity} blocks is too many for me")
        super().__init__(capacity, table)


class NotAPolicy:
    pass


register_policy("explodes", f"{__name__}:Explodes")
register_policy("alsoexplodes", f"{__name__}:AlsoExplodes")
register_policy("repeats", f"{__name__}:Repeats")
register_policy("bigonly", f"{__name__}:BigOnly")
register_policy("unbuildable", f"{__name__}:Unbuildable")
register_policy("notapolicy", f"{__name__}:NotAPolicy")
"""


def replay_own(
    path: Path, policies: str, capacity: str, limit: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``kvoffload replay`` of the synthetic trace with ``own_policies``
    imported from ``path``."""
    return kvoffload(
        "replay", SYNTHETIC, "--import", "own_policies", "--policy", policies,
        "--capacity", capacity, "--limit", limit, *extra, path=path,
    )  # fmt: skip


@pytest.fixture
def own_policies(tmp_path: Path) -> Path:
    """A folder holding ``own_policies.py``, which registers broken policies."""
    (tmp_path / "own_policies.py").write_text(POLICIES)
    return tmp_path


@pytest.mark.parametrize("json_output", [False, True])
def test_cli_a_policy_that_raises_is_named_and_the_others_still_print(
    own_policies: Path, json_output: bool
) -> None:
    # once a traceback, and the runs already done lost
    done = replay_own(
        own_policies, "lru,explodes,arc", "10,20", "300", *(["--json"] if json_output else [])
    )
    assert done.returncode == 1
    assert re.fullmatch(
        r"kvoffload replay: error: policy 'explodes' failed on trace "
        r"mooncake_synthetic_trace.jsonl \(capacity 10 blocks\) at request \d+: "
        r"RuntimeError: evict exploded\n",
        done.stderr,
    ), done.stderr
    # the others ran at every capacity; the broken one is not run again
    expected = [("lru", 10), ("arc", 10), ("lru", 20), ("arc", 20)]
    if json_output:
        runs = json.loads(done.stdout)["runs"]
        assert [(r["policy"], r["capacity_blocks"]) for r in runs] == expected
    else:
        rows = [line.split() for line in done.stdout.splitlines()[1:]]
        assert [(r[1], int(r[2])) for r in rows] == expected


def test_cli_each_failed_policy_is_one_line_in_command_line_order(own_policies: Path) -> None:
    done = replay_own(own_policies, "alsoexplodes,lru,explodes", "10", "300")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert [line.split("'")[1] for line in lines] == ["alsoexplodes", "explodes"], lines
    assert all("failed on trace" in line for line in lines)
    assert [row.split()[1] for row in done.stdout.splitlines()[1:]] == ["lru"]


def test_cli_a_contract_breach_is_reported_like_any_failure(own_policies: Path) -> None:
    # the manager's own refusal (PolicyContractError) goes the same way
    done = replay_own(own_policies, "repeats,lru", "10", "300")
    assert done.returncode == 1
    assert re.fullmatch(
        r"kvoffload replay: error: policy 'repeats' failed on trace \S+ \(capacity 10 "
        r"blocks\) at request \d+: PolicyContractError: eviction policy 'repeats' broke its "
        r"contract: evict answered a victim more than once .*\n",
        done.stderr,
    ), done.stderr
    assert [row.split()[1] for row in done.stdout.splitlines()[1:]] == ["lru"]


def test_cli_every_policy_is_built_at_every_capacity_first(own_policies: Path) -> None:
    # built at 10 blocks it works; at 20 its constructor raises: nothing runs
    done = replay_own(own_policies, "lru,bigonly", "10,20", "100")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "kvoffload replay: error: policy 'bigonly' cannot be built for 20 blocks: "
        "MemoryError: 20 blocks is too many for me\n"
    )


def test_cli_repeated_imports_add_up(tmp_path: Path) -> None:
    for name in ("first_policies", "second_policies"):
        (tmp_path / f"{name}.py").write_text(
            "from kvoffload.policies import register_policy\n"
            f"register_policy('{name[:-9]}', 'kvoffload.policies.lru:LRUPolicy')\n"
        )
    done = kvoffload(
        "replay", SYNTHETIC, "--import", "first_policies", "--import", "second_policies",
        "--policy", "first,second", "--capacity", "10", "--limit", "50", path=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [row.split()[1] for row in done.stdout.splitlines()[1:]] == ["first", "second"]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (
            "unbuildable",
            "policy 'unbuildable' cannot be built for 10 blocks: TypeError: "
            "Unbuildable.__init__() takes 1 positional argument but 3 were given",
        ),
        (
            "notapolicy",
            "eviction policy 'notapolicy' is registered as 'own_policies:NotAPolicy', which is "
            "not an EvictionPolicy subclass",
        ),
    ],
)
def test_cli_a_policy_that_cannot_be_built_is_refused_before_any_replay(
    own_policies: Path, policy: str, expected: str
) -> None:
    # once a traceback after the other policies' runs, whose results were lost
    done = replay_own(own_policies, f"lru,{policy}", "10", "100")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"kvoffload replay: error: {expected}\n"


# --------------------------------------------------------------------------- output


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args",
    [
        ["replay", SYNTHETIC, "--policy", "lru", "--capacity", "10", "--limit", "50"],
        ["replay", SYNTHETIC, "--policy", "lru", "--capacity", "10", "--limit", "50", "--json"],
        ["replay", "--help"],
        ["--version"],
    ],
)
def test_cli_output_that_cannot_be_written_is_one_line_and_status_74(args: list[str]) -> None:
    # once an OSError traceback (the replay), or nothing and status 0 (--help)
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "kvoffload.cli", *args],
            stdout=full, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 74
    prog = "kvoffload replay" if args[0] == "replay" else "kvoffload"
    assert done.stderr == (
        f"{prog}: error: cannot write to standard output: No space left on device\n"
    )


def test_cli_replay_with_stdout_closed_says_so() -> None:
    # `kvoffload replay ... >&-`: once an AttributeError traceback after the whole replay
    done = subprocess.run(
        ["sh", "-c", 'exec "$0" -m kvoffload.cli replay "$1" --limit 50 >&-', sys.executable,
         SYNTHETIC],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 74
    assert done.stderr == (
        "kvoffload replay: error: standard output is closed; redirect it to a file (> FILE) "
        "or to /dev/null\n"
    )


def _replay_output_doc() -> str:
    return (REPO / "docs" / "replay.md").read_text()


def _documented(section: str, heading: str) -> list[str]:
    """The names in the first column of the table under ``heading``."""
    table = section.split(heading, 1)[1].split("\n\n", 2)[1]
    return re.findall(r"^\| `([^`]+)` \|", table, re.M)


def _json_keys(document: dict[str, object]) -> list[str]:
    """Every key of a replay document: ``runs[].policy`` for a key of the
    objects in a list."""
    keys = []
    for key, value in document.items():
        keys.append(key)
        if isinstance(value, list):
            keys += [f"{key}[].{k}" for k in value[0]]
    return keys


def test_cli_replay_output_is_documented_key_by_key_and_column_by_column() -> None:
    section = _replay_output_doc()
    done = kvoffload(
        "replay", SYNTHETIC, "--policy", "hkvarc", "--capacity", "1%", "--limit", "300",
        "--lookahead", "8", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _documented(section, "JSON document (`--json`)") == _json_keys(json.loads(done.stdout))
    table = kvoffload("replay", SYNTHETIC, "--policy", "lru", "--capacity", "10", "--limit", "50")
    assert table.returncode == 0, table.stderr
    columns = re.split(r" {2,}", table.stdout.splitlines()[0])
    assert _documented(section, "Table (the default)") == columns


# --------------------------------------------------------------------------- trace paths


def test_cli_traces_of_the_same_name_are_told_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # once both were "t.jsonl", the rows of one indistinguishable from the other's
    lines = Path(SYNTHETIC).read_text().splitlines(keepends=True)
    paths = [
        tmp_path / "a" / "t.jsonl",
        tmp_path / "b" / "t.jsonl",
        tmp_path / "x" / "a" / "t.jsonl",
    ]
    for n, path in enumerate(paths):
        path.parent.mkdir(parents=True)
        path.write_text("".join(lines[: 30 + 10 * n]))
    status, out, err = run_main(
        ["replay", *map(str, paths), "--policy", "lru", "--capacity", "10", "--json"], capsys
    )
    assert status == 0, err
    document = json.loads(out)
    labels = [f"{tmp_path.name}/a/t.jsonl", "b/t.jsonl", "x/a/t.jsonl"]
    assert [t["trace"] for t in document["traces"]] == labels
    assert [r["trace"] for r in document["runs"]] == labels
    assert [t["requests"] for t in document["traces"]] == [30, 40, 50]


def test_cli_reads_a_trace_from_stdin() -> None:
    # once "trace file not found: /dev/stdin"
    head = "".join(Path(SYNTHETIC).read_text().splitlines(keepends=True)[:40])
    done = kvoffload("replay", "/dev/stdin", "--policy", "lru", "--capacity", "10", stdin=head)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].split()[:3] == ["stdin", "lru", "10"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_cli_reads_a_trace_from_a_fifo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    head = "".join(Path(SYNTHETIC).read_text().splitlines(keepends=True)[:40])
    writer = threading.Thread(target=fifo.write_text, args=(head,), daemon=True)
    writer.start()
    status, out, err = run_main(["replay", str(fifo), "--policy", "lru", "--json"], capsys)
    writer.join(10)
    assert status == 0, err
    trace = json.loads(out)["traces"][0]
    assert (trace["trace"], trace["requests"]) == ("trace.fifo", 40)


def test_cli_repeated_list_options_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    # once the last --policy and the last --capacity won, silently
    status, out, err = run_main(
        ["replay", SYNTHETIC, "--limit", "100", "--policy", "lru", "--policy", "arc,kvarc",
         "--capacity", "10", "--capacity", "20,30", "--json"],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    runs = [(r["capacity_blocks"], r["policy"]) for r in json.loads(out)["runs"]]
    assert runs == [(c, p) for c in (10, 20, 30) for p in ("lru", "arc", "kvarc")]
