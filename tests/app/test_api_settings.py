"""Settings from KVOFFLOAD_* variables and `kvoffload serve` flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.engine_setup import engine_config, load_workload
from app.flags import ENV_ONLY, build_parser, env_name, flag_name, parse_settings
from app.main import run
from app.settings import Settings
from kvoffload.policies import available_policies
from kvoffload.runtime import EngineConfig
from kvoffload.runtime.workloads import LoopedWorkload

TRACE = str(Path(__file__).resolve().parents[2] / "data/traces/mooncake_conversation_trace.jsonl")


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
    monkeypatch.setenv("KVOFFLOAD_CAPACITY", "128")
    monkeypatch.setenv("KVOFFLOAD_LOOP", "false")
    s = Settings()
    assert (s.host, s.port, s.policy, s.capacity, s.loop) == ("0.0.0.0", 9100, "arc", 128, False)
    assert s.admin_token is not None and s.admin_token.get_secret_value() == "a"
    assert s.read_token is not None and s.read_token.get_secret_value() == "r"


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_PORT", "9100")
    monkeypatch.setenv("KVOFFLOAD_POLICY", "arc")
    s = parse_settings(["--port", "9200", "--no-loop", "--speed", "2.5", "--capacity", "64"])
    assert s.port == 9200
    assert s.policy == "arc"  # from the environment
    assert s.loop is False
    assert s.speed == 2.5
    assert s.capacity == 64


def test_help_lists_every_flag_with_its_env_var() -> None:
    text = build_parser().format_help()
    for name in Settings.model_fields:
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
        (["--capacity", "0"], "--capacity / KVOFFLOAD_CAPACITY"),
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
        (["--gpu-block-size", "48"], "must be a multiple of gpu_block_size (48)"),
        (["--device", "cuda:7"], "device 'cuda:7' is not available"),
        (["--device", "tpu"], "device must be 'auto', 'cpu' or 'cuda[:n]'"),
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


def test_speed_zero_means_as_fast_as_possible() -> None:
    assert engine_config(Settings(speed=0)).speed is None
    assert engine_config(Settings(speed=3.0)).speed == 3.0
