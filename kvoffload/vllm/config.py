"""``kv_connector_extra_config`` of :class:`~kvoffload.vllm.KVOffloadSpec`.

Checked before vLLM's own ``OffloadingSpec.__init__`` runs (which would fail
with a bare ``assert`` on a block size that does not divide), and all at once:
every problem of the dict is named in one :class:`~kvoffload.errors.ConfigError`
together with what is allowed. No vLLM import here, so it is tested without it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from kvoffload._checks import is_int
from kvoffload.errors import ConfigError, PolicyError
from kvoffload.event_log import DEFAULT_CAPACITY
from kvoffload.policies import available_policies, import_policy_modules, policy_class
from kvoffload.spec import CPUOffloadingSpec, OffloadingConfig, _positive_int

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "EXTRA_CONFIG_KEYS",
    "MAX_LOOKAHEAD",
    "MAX_PORT",
    "SPEC_MODULE_PATH",
    "SPEC_NAME",
    "admin_port",
    "lookahead",
    "offloading_config",
    "row_kernel",
]

SPEC_NAME = "KVOffloadSpec"
SPEC_MODULE_PATH = "kvoffload.vllm"

#: Every key the spec reads (docs/vllm.md says what each means): vLLM's, and
#: five of its own
EXTRA_CONFIG_KEYS = (
    *CPUOffloadingSpec.EXTRA_CONFIG_KEYS,
    "policy_modules",
    "admin_port",
    "lookahead",
    "row_kernel",
    "event_log_capacity",
)

#: the ports ``admin_port`` may name (0: any free port)
MAX_PORT = 65535
#: waiting requests :class:`~kvoffload.vllm.HintingScheduler` hints by default
DEFAULT_LOOKAHEAD = 64
#: the most it may hint (``sys.maxsize``, what ``itertools.islice`` takes: a
#: whole waiting queue)
MAX_LOOKAHEAD = sys.maxsize


def offloading_config(
    extra: Mapping[str, Any], gpu_block_size: int, *, enable_events: bool = False
) -> OffloadingConfig:
    """The :class:`~kvoffload.spec.OffloadingConfig` an extra config asks for.

    ``gpu_block_size`` is vLLM's ``cache_config.block_size``. Raises one
    :class:`~kvoffload.errors.ConfigError` listing every problem: unknown
    keys (with the valid ones), ``num_cpu_blocks`` missing or not a positive
    integer, ``block_size`` not a positive multiple of ``gpu_block_size``, an
    unknown ``eviction_policy`` (with the registered ones, those of the
    ``policy_modules`` it imports first included), an ``admin_port``
    that is not an integer from 0 to 65535 (read it with :func:`admin_port`), a
    ``lookahead`` that is not an integer from 0 to :data:`MAX_LOOKAHEAD`
    (:func:`lookahead`), a ``row_kernel`` that is not true, false or null
    (:func:`row_kernel`), an ``event_log_capacity`` that is not a positive
    integer.
    """
    problems: list[str] = []
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        problems.append(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"(valid keys: {', '.join(EXTRA_CONFIG_KEYS)})"
        )

    num_cpu_blocks = 0
    if "num_cpu_blocks" not in extra:
        problems.append("num_cpu_blocks is required: the CPU tier size in offloaded blocks")
    else:
        try:
            num_cpu_blocks = _positive_int("num_cpu_blocks", extra["num_cpu_blocks"])
        except ConfigError as exc:
            problems.append(str(exc))

    event_log_capacity = DEFAULT_CAPACITY
    if "event_log_capacity" in extra:
        try:
            event_log_capacity = _positive_int("event_log_capacity", extra["event_log_capacity"])
        except ConfigError as exc:
            problems.append(str(exc))

    block_size = gpu_block_size
    if "block_size" in extra:
        multiples = ", ".join(str(gpu_block_size * k) for k in (1, 2, 4))
        try:
            block_size = _positive_int("block_size", extra["block_size"])
        except ConfigError:
            block_size = 0
        if block_size <= 0 or block_size % gpu_block_size:
            problems.append(
                f"block_size {extra['block_size']!r} is not a positive multiple of vLLM's "
                f"block size {gpu_block_size} (cache_config.block_size): use e.g. {multiples}"
            )

    modules = extra.get("policy_modules", [])
    if not isinstance(modules, list | tuple) or not all(
        isinstance(m, str) and m.strip() for m in modules
    ):
        problems.append(
            f"policy_modules must be a list of module names (modules that register "
            f"policies of their own), got {modules!r}"
        )
    else:
        try:
            import_policy_modules(m.strip() for m in modules)
        except PolicyError as exc:
            problems.append(f"policy_modules: {exc}")

    policy = extra.get("eviction_policy", "lru")
    try:
        policy_class(policy)
    except (PolicyError, TypeError):  # TypeError: not even hashable
        problems.append(
            f"eviction_policy {policy!r} is unknown (registered policies: "
            f"{', '.join(available_policies())})"
        )

    for check in (admin_port, lookahead, row_kernel):
        try:
            check(extra)
        except ConfigError as exc:
            problems.append(str(exc))

    if problems:
        raise ConfigError(
            f"kv_connector_extra_config for {SPEC_MODULE_PATH}.{SPEC_NAME}: " + "; ".join(problems)
        )
    return OffloadingConfig(
        gpu_block_size=gpu_block_size,
        num_cpu_blocks=num_cpu_blocks,
        offloaded_block_size=block_size,
        eviction_policy=str(policy),
        enable_events=enable_events,
        event_log_capacity=event_log_capacity,
        spec_name=SPEC_NAME,
        spec_module_path=SPEC_MODULE_PATH,
    )


def admin_port(extra: Mapping[str, Any]) -> int | None:
    """The extra config's ``admin_port``: ``None`` when absent (no admin
    server), 0 for any free port. Raises :class:`~kvoffload.errors.ConfigError`
    when it is not an integer from 0 to 65535."""
    if "admin_port" not in extra:
        return None
    port = extra["admin_port"]
    if not is_int(port) or not 0 <= port <= MAX_PORT:
        raise ConfigError(
            f"admin_port must be an integer from 0 to {MAX_PORT} (0: any free port), got {port!r}"
        )
    return port


def lookahead(extra: Mapping[str, Any]) -> int:
    """The extra config's ``lookahead``: how many waiting requests
    :class:`~kvoffload.vllm.HintingScheduler` hints to the manager (0: none;
    :data:`DEFAULT_LOOKAHEAD` when absent). Raises
    :class:`~kvoffload.errors.ConfigError` when it is not an integer from 0
    to :data:`MAX_LOOKAHEAD` (10**30 passed, then failed every ``schedule()``)."""
    n = extra.get("lookahead", DEFAULT_LOOKAHEAD)
    if not is_int(n) or not 0 <= n <= MAX_LOOKAHEAD:
        raise ConfigError(
            f"lookahead must be an integer from 0 to {MAX_LOOKAHEAD} (waiting requests the "
            f"HintingScheduler hints; 0: none), got {n!r}"
        )
    return n


def row_kernel(extra: Mapping[str, Any]) -> bool | None:
    """The extra config's ``row_kernel``, the handler's choice of copy path
    for scattered blocks on CUDA (docs/transfer.md): ``None`` (absent or
    null) lets the handler choose, ``False`` keeps every copy on the copy
    engines (the model's kernels keep every SM), ``True`` sends every job to
    the row kernel. Raises :class:`~kvoffload.errors.ConfigError` for
    anything else."""
    choice = extra.get("row_kernel")
    if not (choice is None or isinstance(choice, bool)):
        raise ConfigError(
            "row_kernel must be true (every CUDA copy by the row kernel), false (copy "
            f"engines only) or null (the handler chooses, the default), got {choice!r}"
        )
    return choice
