"""Settings from KVOFFLOAD_* variables and `kvoffload serve` flags."""

from __future__ import annotations

import dataclasses
import gzip
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.engine_setup import engine_config, load_workload
from app.flags import (
    ENV_ONLY,
    OTHER_VARIABLES,
    build_parser,
    env_name,
    flag_name,
    parse_settings,
    unknown_variables,
)
from app.main import run
from app.settings import RENAMED, Settings
from kvoffload.policies import available_policies
from kvoffload.runtime import EngineConfig
from kvoffload.runtime.workloads import LoopedWorkload

ROOT = Path(__file__).resolve().parents[2]
TRACE = str(ROOT / "data/traces/mooncake_conversation_trace.jsonl")


def test_defaults() -> None:
    s = Settings()
    assert (s.host, s.port, s.policy, s.workload) == ("127.0.0.1", 8000, "lru", "builtin")
    assert s.admin_token is None and s.read_token is None
    assert s.speed == 1.0 and s.loop is True


def test_engine_defaults_are_the_engines() -> None:
    """Without flags the service runs the engine's own default shape, except
    for pacing: the service replays in real time, the library as fast as it can."""
    ours = engine_config(Settings())
    theirs = EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        if field.name == "speed":
            continue
        assert getattr(ours, field.name) == getattr(theirs, field.name), field.name
    assert ours.speed == 1.0 and theirs.speed is None


def test_env_names_operators_script_against(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_HOST", "0.0.0.0")
    monkeypatch.setenv("KVOFFLOAD_PORT", "9100")
    monkeypatch.setenv("KVOFFLOAD_POLICY", "ARC")
    monkeypatch.setenv("KVOFFLOAD_ADMIN_TOKEN", "a")
    monkeypatch.setenv("KVOFFLOAD_READ_TOKEN", "r")
    monkeypatch.setenv("KVOFFLOAD_NUM_CPU_BLOCKS", "128")
    monkeypatch.setenv("KVOFFLOAD_LOOP", "false")
    s = Settings()
    assert (s.host, s.port, s.policy, s.num_cpu_blocks, s.loop) == (
        "0.0.0.0",
        9100,
        "arc",
        128,
        False,
    )
    assert s.admin_token is not None and s.admin_token.get_secret_value() == "a"
    assert s.read_token is not None and s.read_token.get_secret_value() == "r"


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_PORT", "9100")
    monkeypatch.setenv("KVOFFLOAD_POLICY", "arc")
    s = parse_settings(["--port", "9200", "--no-loop", "--speed", "2.5", "--num-cpu-blocks", "64"])
    assert s.port == 9200
    assert s.policy == "arc"  # from the environment
    assert s.loop is False
    assert s.speed == 2.5
    assert s.num_cpu_blocks == 64


def test_help_lists_every_flag_with_its_env_var() -> None:
    text = build_parser().format_help()
    for name in Settings.model_fields:
        if name in RENAMED:
            assert flag_name(name) not in text, name
            continue
        assert env_name(name) in text, name
        if name not in ENV_ONLY:
            assert flag_name(name) in text, name
    assert "--admin-token" not in text  # secrets stay out of argv


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--port", "65536"], "--port / KVOFFLOAD_PORT"),
        (["--port", "http"], "--port / KVOFFLOAD_PORT"),
        (["--policy", "fifo"], f"valid policies: {', '.join(available_policies())}"),
        (["--speed", "-1"], "--speed / KVOFFLOAD_SPEED"),
        (["--host", "0.0.0.0"], "without an admin token"),
        (["--num-cpu-blocks", "0"], "--num-cpu-blocks / KVOFFLOAD_NUM_CPU_BLOCKS"),
        (
            ["--imports", "no_such_policies_xyz", "--policy", "fifo"],
            "--imports / KVOFFLOAD_IMPORTS: cannot import 'no_such_policies_xyz': "
            "ModuleNotFoundError: No module named 'no_such_policies_xyz' (it must be importable",
        ),
        (["--imports", "json,,os"], "an empty module name in 'json,,os'"),
        (["--workload", " "], "--workload / KVOFFLOAD_WORKLOAD: empty; give 'builtin' or the path"),
    ],
)
def test_bad_settings_exit_2_with_a_clear_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvoffload serve: error: ")
    assert fragment in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--workload", "/no/such/trace.jsonl"], "trace file not found: /no/such/trace.jsonl"),
        # once served, logging "0 requests ... looped endlessly"
        (["--workload", "/dev/null"], "/dev/null: no requests (the file is empty"),
        # the library's cross-field checks, in the flags' and variables' words
        (
            ["--gpu-block-size", "48"],
            "error: --offloaded-block-size / KVOFFLOAD_OFFLOADED_BLOCK_SIZE (64) must be a "
            "multiple of --gpu-block-size / KVOFFLOAD_GPU_BLOCK_SIZE (48)",
        ),
        (
            ["--gpu-blocks", "1"],
            "error: --gpu-blocks / KVOFFLOAD_GPU_BLOCKS (1) must hold one offloaded block "
            "(4 GPU blocks); raise --gpu-blocks or lower --offloaded-block-size / "
            "KVOFFLOAD_OFFLOADED_BLOCK_SIZE",
        ),
        # the value itself, as with argparse's own errors ("invalid choice: 'int8'")
        (
            ["--num-cpu-blocks", "abc"],
            "--num-cpu-blocks / KVOFFLOAD_NUM_CPU_BLOCKS: Input should be a valid integer, "
            "unable to parse string as an integer, got 'abc'",
        ),
        (["--device", "cuda:7"], "device 'cuda:7' is not available"),
        (["--device", "tpu"], "device must be 'auto', 'cpu' or 'cuda[:n]'"),
        # a traceback from torch's allocator, and a minute of allocating layers
        (
            ["--device", "cpu", "--gpu-blocks", "1000000000"],
            "the simulated GPU KV cache needs 4096000000000 bytes (1000000000 GPU blocks x 2 "
            "layers x 2 x 1024 bytes) on the CPU, above",
        ),
        (
            ["--device", "cpu", "--num-layers", "100000000"],
            "lower the GPU blocks or layers (kvoffload serve: --gpu-blocks / "
            "KVOFFLOAD_GPU_BLOCKS, --num-layers / KVOFFLOAD_NUM_LAYERS)",
        ),
    ],
)
def test_bad_inputs_fail_before_serving(
    argv: list[str], fragment: str, capfd: pytest.CaptureFixture[str]
) -> None:
    assert run([*argv, "--port", "1"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("kvoffload serve: error: ")
    assert fragment in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_a_paced_loop_of_a_trace_with_one_timestamp_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # found by an audit: a pass took no time, so at --speed 1 the passes came
    # at once, for ever (20,000 requests a second and a whole core)
    trace = tmp_path / "one-time.jsonl"
    line = '{"timestamp": 5, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}\n'
    trace.write_text(line * 3)
    assert run(["--workload", str(trace), "--port", "1"]) == 2
    err = capfd.readouterr().err
    assert err == (
        f"kvoffload serve: error: every request of {trace} arrives at the same time, so looped "
        "(--loop / KVOFFLOAD_LOOP) at --speed / KVOFFLOAD_SPEED 1 it would come at no rate: "
        "use speed 0 (as fast as possible) or --no-loop\n"
    )
    # as fast as possible, or once through, it is a workload like any other
    assert isinstance(load_workload(Settings(workload=str(trace), speed=0)), LoopedWorkload)
    assert load_workload(Settings(workload=str(trace), loop=False)) is not None


def test_a_bad_boolean_variable_names_its_value_and_the_words_allowed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVOFFLOAD_LOOP", "maybe")
    assert run(["--port", "1"]) == 2
    assert capsys.readouterr().err == (
        "kvoffload serve: error: --loop / KVOFFLOAD_LOOP: Input should be a valid boolean, "
        "unable to interpret input, got 'maybe' (use true or false; also 1/0, yes/no, on/off)\n"
    )


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            ["--capacity", "64"],
            {},
            "--capacity / KVOFFLOAD_CAPACITY: renamed: use --num-cpu-blocks / "
            "KVOFFLOAD_NUM_CPU_BLOCKS",
        ),
        (
            [],
            {"KVOFFLOAD_CAPACITY": "64"},
            "--capacity / KVOFFLOAD_CAPACITY: renamed: use --num-cpu-blocks / "
            "KVOFFLOAD_NUM_CPU_BLOCKS",
        ),
        (
            [],
            {"KVOFFLOAD_EVENT_RING_SIZE": "500"},
            "--event-ring-size / KVOFFLOAD_EVENT_RING_SIZE: renamed: use --event-log-capacity / "
            "KVOFFLOAD_EVENT_LOG_CAPACITY",
        ),
        (
            ["--event-ring-size=oops"],
            {},
            "--event-ring-size / KVOFFLOAD_EVENT_RING_SIZE: renamed: use --event-log-capacity / "
            "KVOFFLOAD_EVENT_LOG_CAPACITY",
        ),
    ],
)
def test_a_renamed_setting_fails_naming_its_new_name(
    argv: list[str],
    env: dict[str, str],
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # issue 17: the service said capacity and event_ring_size where the
    # library and vLLM say num_cpu_blocks and event_log_capacity; an old name
    # must not be silently ignored
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run([*argv, "--port", "1"]) == 2
    assert capsys.readouterr().err == f"kvoffload serve: error: {line}\n"
    with pytest.raises(ValidationError, match="renamed: use --num-cpu-blocks"):
        Settings(capacity=32)  # type: ignore[call-arg]


def test_settings_are_named_as_the_engine_config_names_them() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    for old, new in RENAMED.items():
        assert new in Settings.model_fields and new in engine, new
        assert old not in engine


def test_unknown_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--colour", "blue"])
    assert exc.value.code == 2
    assert "--colour" in capsys.readouterr().err


def test_settings_reject_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        Settings(polcy="arc")  # type: ignore[call-arg]


def test_trace_workload_is_loaded_and_looped() -> None:
    workload = load_workload(Settings(workload=TRACE))
    assert isinstance(workload, LoopedWorkload)
    assert "Mooncake trace" in workload.describe()
    once = load_workload(Settings(workload=TRACE, loop=False))
    assert once is not None and not isinstance(once, LoopedWorkload)
    assert load_workload(Settings(workload="builtin")) is None


def test_a_gzip_trace_workload_is_read_through(tmp_path: Path) -> None:
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(Path(TRACE).read_bytes()))
    once = load_workload(Settings(workload=str(packed), loop=False))
    plain = load_workload(Settings(workload=TRACE, loop=False))
    assert once is not None and plain is not None
    assert list(once) == list(plain)


def test_speed_zero_means_as_fast_as_possible() -> None:
    assert engine_config(Settings(speed=0)).speed is None
    assert engine_config(Settings(speed=3.0)).speed == 3.0


def _doc_rows(path: Path, heading: str) -> list[list[str]]:
    """The cells of the first table under ``heading`` (backticks stripped)."""
    text = path.read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines():
        if line.startswith("|---"):
            continue
        if line.startswith("|"):
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[1:]  # the header row


def _is_default(field: str, documented: str) -> bool:
    default = Settings.model_fields[field].default
    if default is None:
        return documented == "unset"
    if default == "":
        return documented == "(none)"
    if isinstance(default, bool):
        return documented == str(default).lower()
    if isinstance(default, int | float):
        return float(documented) == default
    return documented == str(default)


def test_docs_settings_table_lists_every_setting_with_its_flag_and_default() -> None:
    rows = _doc_rows(ROOT / "docs" / "api.md", "## Settings")
    documented = {row[0]: row for row in rows}
    current = {name for name in Settings.model_fields if name not in RENAMED}
    assert set(documented) == {env_name(name) for name in current}
    for name in current:
        _, flag, default, _ = documented[env_name(name)]
        if name in ENV_ONLY:
            assert flag == "—", name
        else:
            assert flag.split(" / ")[0].strip("`") == flag_name(name), name
        assert _is_default(name, default), (name, default)


def test_readme_configuration_names_only_current_settings() -> None:
    rows = _doc_rows(ROOT / "README.md", "## Configuration")
    variables = {v.strip("` ") for row in rows for v in row[0].split("/")}
    known = {env_name(name) for name in Settings.model_fields if name not in RENAMED}
    assert variables - {"OTEL_EXPORTER_OTLP_ENDPOINT"} <= known
    flags = {f.strip("` ") for row in rows for f in row[1].split("/")} - {"—"}
    assert flags <= {flag_name(name) for name in Settings.model_fields if name not in RENAMED}


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--speed"], "argument --speed: expected one argument"),
    ],
)
def test_flag_errors_are_one_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse printed its 27-line usage block first
    with pytest.raises(SystemExit) as exit_:
        parse_settings(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"kvoffload serve: error: {line}" + err.split(line, 1)[1]
    assert len(err.splitlines()) == 1 and "(see 'kvoffload serve --help')" in err


def test_unknown_variables_are_warned_about_with_the_nearest_setting() -> None:
    # a typo (KVOFFLOAD_SPEEED=0) was ignored in silence
    environ = {
        "KVOFFLOAD_SPEEED": "0",
        "KVOFFLOAD_SPEED": "0",
        "KVOFFLOAD_TORCH": "torch==2.13.0",  # scripts/install's, not a setting
        "KVOFFLOAD_CAPACITY": "8",  # renamed: refused by the settings themselves
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        "KVOFFLOAD_SPEEED is not a setting and is ignored; did you mean KVOFFLOAD_SPEED?"
    ]


#: where the project's own scripts read ``KVOFFLOAD_*`` variables that are no setting
SCRIPT_PLACES = ("scripts", ".ci", "docker-compose.yml", "Dockerfile", "bench")


def _script_variables() -> set[str]:
    names: set[str] = set()
    for place in SCRIPT_PLACES:
        path = ROOT / place
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and "__pycache__" not in file.parts:
                text = file.read_text(errors="replace")
                names.update(re.findall(r"KVOFFLOAD_[A-Z_]*[A-Z]", text))
    return names


def test_the_scripts_own_variables_are_not_warned_about() -> None:
    names = _script_variables()
    assert {"KVOFFLOAD_TORCH", "KVOFFLOAD_VLLM_WHEEL"} <= names  # the scan finds them
    assert unknown_variables(dict.fromkeys(names, "1")) == []


def test_the_docs_name_exactly_the_variables_that_are_not_warned_about() -> None:
    text = " ".join((ROOT / "docs" / "api.md").read_text().split())
    found = re.search(
        r"\(the variables of the install, test and compose files and of the\s+table's choice "
        r"excepted, exactly these: ([^)]*)\)",
        text,
    )
    assert found, "docs/api.md, Settings: the sentence naming the exceptions"
    named = set(re.findall(r"`(KVOFFLOAD_[A-Z_]+)`", found.group(1)))
    assert named == OTHER_VARIABLES
    assert named <= _script_variables()  # each is one the scripts really use


def test_readme_configuration_gives_the_real_defaults() -> None:
    field_of = {env_name(name): name for name in Settings.model_fields}
    checked = 0
    for env, _, default, _ in _doc_rows(ROOT / "README.md", "## Configuration"):
        names = [v.strip("` ") for v in env.split("/")]
        defaults = [d.strip("` ") for d in default.split("/")]
        if len(defaults) == 1:
            defaults *= len(names)  # one default for both (the tokens: unset)
        for var, value in zip(names, defaults, strict=True):
            if var in field_of:
                assert _is_default(field_of[var], value), (var, value)
                checked += 1
    assert checked >= 14
