"""Service settings: ``KVOFFLOAD_*`` environment variables, overridden by the
flags of ``kvoffload serve`` (see :mod:`app.flags`).

Tokens are read from the environment only: a flag would show them in every
process listing.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.policy_name import SettingsPolicyName
from kvoffload.event_log import DEFAULT_CAPACITY
from kvoffload.policies import available_policies, import_policy_modules
from kvoffload.runtime.config import MAX_WAITING_REQUESTS

__all__ = ["ENV_PREFIX", "RENAMED", "LogLevel", "Settings", "env_name", "flag_name", "is_loopback"]

ENV_PREFIX = "KVOFFLOAD_"

#: settings renamed to the library's (and vLLM's) words: old name -> new name.
#: An old name, as a variable, a flag or a keyword, fails at start with one
#: line naming the new one instead of being ignored.
RENAMED = {"capacity": "num_cpu_blocks", "event_ring_size": "event_log_capacity"}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


LogLevel = Literal["debug", "info", "warning", "error", "critical"]

PositiveInt = Annotated[int, Field(ge=1)]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything ``kvoffload serve`` can be told. Field descriptions double as
    the ``--help`` text."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,
    )

    # -- network -------------------------------------------------------------
    host: str = Field(
        default="127.0.0.1",
        description="interface to bind; anything but loopback needs an admin token",
    )
    port: int = Field(
        default=8000, ge=0, le=65535, description="TCP port to listen on (0: any free port)"
    )

    # -- cache and engine ----------------------------------------------------
    # before `policy`: fields are validated in this order, and the modules
    # register the names `policy` may take
    imports: str = Field(
        default="",
        description="comma-separated modules to import first: modules that register "
        "policies of their own (kvoffload.policies.register_policy), so that --policy "
        "and PUT /v1/policy can name them",
    )
    policy: SettingsPolicyName = Field(
        default="lru",
        description=f"eviction policy at start: {', '.join(available_policies())}",
    )
    num_cpu_blocks: PositiveInt = Field(
        default=2048,
        description="offloaded blocks the CPU tier holds (of --offloaded-block-size tokens)",
    )
    gpu_blocks: PositiveInt = Field(default=512, description="blocks of the simulated GPU KV cache")
    gpu_block_size: PositiveInt = Field(default=16, description="tokens per GPU block")
    offloaded_block_size: PositiveInt = Field(
        default=64, description="tokens per offloaded (CPU) block; a multiple of --gpu-block-size"
    )
    num_layers: PositiveInt = Field(default=2, description="layers of the simulated KV tensors")
    num_kv_heads: PositiveInt = Field(default=2, description="KV heads of the simulated KV tensors")
    head_size: PositiveInt = Field(default=16, description="head size of the simulated KV tensors")
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        default="float16", description="dtype of the KV tensors"
    )
    kv_layout: Literal["kv_first", "blocks_first"] = Field(
        default="kv_first", description="KV tensor layout: (2, blocks, ...) or (blocks, 2, ...)"
    )
    device: str = Field(
        default="auto", description="device of the 'GPU' side: auto, cpu or cuda[:N]"
    )
    max_requests_per_step: PositiveInt = Field(
        default=4, description="requests scheduled per engine step"
    )
    max_waiting_requests: PositiveInt = Field(
        default=64,
        description="requests that may wait to be served (at least max_requests_per_step, "
        f"at most {MAX_WAITING_REQUESTS}): the queue the engine hints to the manager, what "
        "hkvarc sees ahead",
    )
    inject_failure_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of transfer jobs failed on purpose (chaos)",
    )

    # -- workload ------------------------------------------------------------
    workload: str = Field(
        default="builtin",
        description="'builtin' (seeded synthetic chats, documents, one-offs) or a Mooncake JSONL trace path",
    )
    # Real time by default: the demo shows live numbers without burning a
    # core; benchmarks and tests ask for 0 (as fast as possible).
    speed: float = Field(
        default=1.0,
        ge=0.0,
        allow_inf_nan=False,
        description="pacing factor on the workload's timestamps (1 = real time); 0 = as fast as possible",
    )
    loop: bool = Field(default=True, description="replay a trace again when it ends")
    trace_block_size: PositiveInt = Field(
        default=512, description="tokens per hash_ids entry of the trace (512 in Mooncake's)"
    )
    seed: int = Field(default=0, ge=0, description="seed of the built-in workload")
    event_log_capacity: PositiveInt = Field(
        default=DEFAULT_CAPACITY,
        description="records the event log keeps before new ones overwrite the oldest",
    )

    # -- auth ------------------------------------------------------------------
    admin_token: SecretStr | None = Field(
        default=None,
        description="bearer token for state-changing routes (unset: they are disabled)",
    )
    read_token: SecretStr | None = Field(
        default=None, description="bearer token for read routes (unset: reads are open)"
    )

    # -- service behaviour -------------------------------------------------------
    log_level: LogLevel = Field(default="info", description="log level of the service")
    command_timeout: float = Field(
        default=10.0,
        gt=0.0,
        le=600.0,
        description="seconds to wait for the engine to apply a command before answering 504",
    )
    stop_timeout: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description="seconds the engine gets at shutdown to finish in-flight jobs",
    )
    pin_threads: bool = Field(
        default=True,
        description="on Linux with 2+ CPUs, keep the engine's thread on one CPU and the "
        "rest of the process (the admin server) on the others, so requests do not move "
        "the engine or cool its caches",
    )
    sse_heartbeat: float = Field(
        default=15.0,
        gt=0.0,
        le=3600.0,
        description="seconds between heartbeat comments on an event stream",
    )

    # -- limits ----------------------------------------------------------------
    max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1,
        le=1024**3,
        description="largest request body accepted; larger ones get 413 unread",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * 1024**2,
        description="largest request line and headers accepted; larger ones get 431 "
        "and the connection is closed",
    )
    header_timeout: float = Field(
        default=10.0,
        gt=0.0,
        le=3600.0,
        description="seconds a client may take to send a request's line and headers "
        "before the connection is closed",
    )
    body_timeout: float = Field(
        default=10.0,
        gt=0.0,
        le=3600.0,
        description="seconds a client may take to send a request's body, once its headers "
        "are in, before it is answered 408 and the connection is closed",
    )
    max_event_streams: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="concurrent event streams (GET /v1/events/stream); more get 503 "
        "with Retry-After",
    )
    sse_max_replay: int = Field(
        default=1000,
        ge=0,
        le=1_000_000,
        description="records a stream replays from its cursor (Last-Event-ID, after_seq) "
        "before it skips to the live tail, telling the client how many it skipped",
    )

    # -- renamed (see RENAMED): rejected, naming the new name --------------------
    capacity: str | None = Field(default=None, exclude=True, description="renamed: num_cpu_blocks")
    event_ring_size: str | None = Field(
        default=None, exclude=True, description="renamed: event_log_capacity"
    )

    @field_validator(*RENAMED, mode="before")
    @classmethod
    def _renamed(cls, value: object, info: ValidationInfo) -> object:
        if value is not None:
            new = RENAMED[str(info.field_name)]
            raise ValueError(f"renamed: use {flag_name(new)} / {env_name(new)}")
        return value

    @field_validator("imports")
    @classmethod
    def _import(cls, value: str) -> str:
        modules = [m.strip() for m in value.split(",")] if value.strip() else []
        if "" in modules:
            raise ValueError(
                f"an empty module name in {value!r}; give module names, comma-separated"
            )
        import_policy_modules(modules)  # a PolicyError is a ValueError: one line, this field's
        return ",".join(modules)

    @field_validator("workload")
    @classmethod
    def _workload_named(cls, value: str) -> str:
        if not value.strip():  # was read as the current folder: "a directory, not a file"
            raise ValueError("empty; give 'builtin' or the path of a Mooncake JSONL trace")
        return value

    @field_validator("admin_token", "read_token", mode="before")
    @classmethod
    def _token_as_written(cls, value: object) -> object:
        # A token with a stray newline (echo "$TOKEN" > file) would be accepted
        # here and then match no client; say so at start instead.
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(text, str):
            if not text:
                raise ValueError(
                    "the token is empty; set a non-empty token or leave the variable unset"
                )
            if text != text.strip():
                raise ValueError(
                    "the token has leading or trailing whitespace (a trailing newline?); "
                    "clients send it without, so it would never match: remove it"
                )
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _exposed_only_with_admin_token(self) -> Settings:
        if self.admin_token is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind {self.host!r} without an admin token: with no "
                f"{ENV_PREFIX}ADMIN_TOKEN the service only listens on loopback "
                "(127.0.0.1, ::1, localhost); set the token or use --host 127.0.0.1"
            )
        return self

    @property
    def reads_open(self) -> bool:
        return self.read_token is None

    @property
    def admin_enabled(self) -> bool:
        return self.admin_token is not None
