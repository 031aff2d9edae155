"""From :class:`~app.settings.Settings` to a configured, not yet started engine."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

from app.settings import Settings, env_name, flag_name
from kvoffload.errors import ConfigError
from kvoffload.runtime import Engine, EngineConfig, EngineObserver
from kvoffload.runtime.trace import load_mooncake_trace
from kvoffload.runtime.workloads import Workload, loop

__all__ = [
    "BUILTIN_WORKLOAD",
    "build_engine",
    "engine_config",
    "load_workload",
    "preloaded_engine_factory",
]

logger = logging.getLogger(__name__)

BUILTIN_WORKLOAD = "builtin"


#: EngineConfig's names of the settings it is given (the others are the same)
_SETTING_OF = {"num_gpu_blocks": "gpu_blocks"}


def _in_settings_words(message: str) -> str:
    """``message`` with each EngineConfig field named as its setting: the
    first mention as its flag and variable, the later ones as its flag."""
    said: set[str] = set()

    def name(match: re.Match[str]) -> str:
        setting = _SETTING_OF.get(match[0], match[0])
        if setting not in Settings.model_fields:
            return match[0]
        first = setting not in said
        said.add(setting)
        return f"{flag_name(setting)} / {env_name(setting)}" if first else flag_name(setting)

    return re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", name, message)


def engine_config(settings: Settings) -> EngineConfig:
    """The engine configuration the settings describe. Raises
    :class:`~kvoffload.errors.ConfigError` when they do not fit together,
    naming the flags and variables (the library names its own fields)."""
    try:
        return _engine_config(settings)
    except ConfigError as exc:
        raise type(exc)(_in_settings_words(str(exc))) from exc


def _engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        policy=settings.policy,
        num_cpu_blocks=settings.num_cpu_blocks,
        num_gpu_blocks=settings.gpu_blocks,
        gpu_block_size=settings.gpu_block_size,
        offloaded_block_size=settings.offloaded_block_size,
        num_layers=settings.num_layers,
        num_kv_heads=settings.num_kv_heads,
        head_size=settings.head_size,
        dtype=settings.dtype,
        kv_layout=settings.kv_layout,
        device=settings.device,
        max_requests_per_step=settings.max_requests_per_step,
        max_waiting_requests=settings.max_waiting_requests,
        event_log_capacity=settings.event_log_capacity,
        speed=settings.speed or None,
        inject_failure_rate=settings.inject_failure_rate,
        seed=settings.seed,
    )


def load_workload(settings: Settings) -> Workload | None:
    """``None`` for the built-in synthetic workload (the engine builds it, looped
    endlessly); otherwise the trace, looped when ``settings.loop``. Raises
    :class:`~kvoffload.runtime.workloads.WorkloadError` naming the file, line
    and field of a bad trace."""
    if settings.workload.strip().lower() == BUILTIN_WORKLOAD:
        return None
    trace = load_mooncake_trace(settings.workload, trace_block_size=settings.trace_block_size)
    if not settings.loop:
        return trace
    times = [r.arrival_time for r in trace.requests]
    if settings.speed and times and max(times) == min(times):
        # a pass takes no time, so at a pace the passes would come at once, for ever
        raise ConfigError(
            f"every request of {settings.workload} arrives at the same time, so looped "
            f"({flag_name('loop')} / {env_name('loop')}) at {flag_name('speed')} / "
            f"{env_name('speed')} {settings.speed:g} it would come at no rate: use speed 0 "
            "(as fast as possible) or --no-loop"
        )
    return loop(trace)


def build_engine(settings: Settings, observers: Sequence[EngineObserver] = ()) -> Engine:
    return Engine(engine_config(settings), load_workload(settings), observers)


def preloaded_engine_factory(
    settings: Settings,
) -> Callable[[Settings, Sequence[EngineObserver]], Engine]:
    """Validate the engine configuration and load the workload now (raising
    :class:`~kvoffload.errors.KVOffloadError` naming what is wrong); the
    returned factory builds the engine from them later."""
    config = engine_config(settings)
    workload = load_workload(settings)
    if workload is not None:
        try:
            Engine.check_workload(config, workload)
        except ConfigError as exc:
            raise type(exc)(_in_settings_words(str(exc))) from exc

    def build(_: Settings, observers: Sequence[EngineObserver]) -> Engine:
        return Engine(config, workload, observers)

    return build
