"""The ``kvoffload`` command line: replay output, errors, and the serve hand-over."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from kvoffload._version import __version__
from kvoffload.cli import main
from kvoffload.policies import available_policies
from kvoffload.replay import parse_capacity
from kvoffload.table import IMPLEMENTATION

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "data" / "traces"
CONVERSATION = str(TRACES / "mooncake_conversation_trace.jsonl")
SYNTHETIC = str(TRACES / "mooncake_synthetic_trace.jsonl")


def kvoffload(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a separate process, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
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
        (
            ["replay", SYNTHETIC, "--import", "no_such_module_xyz"],
            "cannot import 'no_such_module_xyz': ModuleNotFoundError",
        ),
        (["replay", SYNTHETIC, "--trace-block-size", "x"], "--trace-block-size"),
        (
            ["replay", SYNTHETIC, "--lookahead", "-8"],
            "argument --lookahead: expected a number of requests to hint ahead, 0 or more, "
            "got '-8'",
        ),
        (["replay", SYNTHETIC, "--lookahead", "many"], "argument --lookahead: expected"),
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
        [sys.executable, "-m", "kvoffload.cli", "replay", SYNTHETIC, "--json", "--limit", "300",
         "--capacity", ",".join(f"{n}" for n in range(1, 400))],
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
