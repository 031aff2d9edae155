"""Every public module of the core library says what it exports (``__all__``),
and what it says is pinned here. ``kvoffload`` itself is pinned in
``test_public_api.py``. ``kvoffload.vllm.spec`` subclasses vLLM's class, so
without vLLM installed (the main suite) its ``__all__`` is read from its source;
``tests/vllm_engine`` imports it for real."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

import kvoffload

PACKAGE = Path(kvoffload.__file__).parent
#: modules that import vLLM, and the names of others that come from them
NEEDS_VLLM = {"kvoffload.vllm.scheduler", "kvoffload.vllm.spec"}
FROM_VLLM_SPEC = {"HintingScheduler", "KVOffloadSpec"}

EXPORTS = {
    "kvoffload.abstract": [
        "BlockHash", "LoadStoreSpec", "OffloadingEvent", "OffloadingManager", "PrepareStoreOutput",
        "SupportsHints",
    ],
    "kvoffload.backend": ["Backend", "BlockStatus", "Handle"],
    "kvoffload.backends": ["CPUBackend", "CPUBlockStatus"],
    "kvoffload.backends.cpu": ["CPUBackend", "CPUBlockStatus"],
    "kvoffload.cli": ["OneLineParser", "main"],
    "kvoffload.errors": [
        "BlockStateError", "ConfigError", "KVOffloadError", "PolicyContractError", "PolicyError",
        "PolicyFailedError", "TransferError",
        "UnknownTicketError",
    ],
    "kvoffload.event_log": [
        "DEFAULT_CAPACITY", "EVENT_KINDS", "EventKind", "EventLog", "EventLogStats", "EventPage",
        "EventRecord",
    ],
    "kvoffload.factory": ["OffloadingSpecFactory"],
    "kvoffload.instrumentation": [
        "ALLOWED_LABELS", "METRICS", "METRICS_BY_NAME", "KVOffloadCollector", "MetricSpec",
        "OTelMetricsBridge", "PrometheusObserver", "TracingObserver", "config_labels",
        "render_markdown_table",
    ],
    "kvoffload.instrumentation.catalogue": [
        "ALLOWED_LABELS", "DIRECTIONS", "DURATION_BUCKETS", "METRICS", "METRICS_BY_NAME",
        "SIZE_BUCKETS", "TRANSFER_OUTCOMES", "MetricSpec", "render_markdown_table",
    ],
    "kvoffload.instrumentation.otel_metrics": ["OTelMetricsBridge"],
    "kvoffload.instrumentation.prometheus": [
        "ApiMetrics", "ConfigLabelValue", "ExemplarSource", "KVOffloadCollector",
        "PrometheusObserver", "SnapshotSource", "config_labels",
    ],
    "kvoffload.instrumentation.tracing": [
        "SPAN_NAMES", "Attr", "EvictionLogs", "LogEvent", "TracingObserver",
    ],
    "kvoffload.manager": ["ARCOffloadingManager", "LRUOffloadingManager", "PolicyOffloadingManager"],
    "kvoffload.mediums": ["BlockIDsLoadStoreSpec", "CPULoadStoreSpec", "GPULoadStoreSpec"],
    "kvoffload.policies": [
        "STAY", "EvictionPolicy", "TouchRules", "Victims", "available_policies", "create_policy",
        "import_policy_modules", "is_builtin", "policy_class", "register_policy",
    ],
    "kvoffload.policies.arc": ["B1", "B2", "T1", "T2", "ARCList", "ARCPolicy", "TwoListPolicy"],
    "kvoffload.policies.base": ["EvictionPolicy", "Victims"],
    "kvoffload.policies.hkvarc": ["HKVARCPolicy"],
    "kvoffload.policies.kvarc": ["GHOST_FACTOR", "KVARCPolicy"],
    "kvoffload.policies.lru": ["LRU", "LRUList", "LRUPolicy"],
    "kvoffload.replay": [
        "BeladyResult", "ReplayError", "ReplayResult", "ReplayTrace", "belady", "parse_capacity",
        "replay",
    ],
    "kvoffload.runtime": [
        "Command", "CommandResult", "Engine", "EngineConfig", "EngineObserver", "EngineSnapshot",
        "EngineStoppedError", "HostedConfig", "HostedManager", "RequestRecord", "RuntimeStats",
        "TransferRecord", "UnsupportedCommandError", "VersionConflictError",
    ],
    "kvoffload.runtime.arrivals": ["Arrivals", "WaitingQueue"],
    "kvoffload.runtime.commands": [
        "Command", "CommandKind", "CommandResult", "EngineStoppedError", "UnsupportedCommandError",
        "VersionConflictError", "apply_switch", "check_version",
    ],
    "kvoffload.runtime.config": ["MAX_WAITING_REQUESTS", "EngineConfig"],
    "kvoffload.runtime.engine": ["ADMIT_PER_STEP", "Engine", "EngineConfig"],
    "kvoffload.runtime.hosted": ["HostedConfig", "HostedManager"],
    "kvoffload.runtime.jobs": ["TransferJobs"],
    "kvoffload.runtime.kv_store": ["GPUKVStore", "block_pattern", "hash_seed"],
    "kvoffload.runtime.observer": [
        "Direction", "EngineObserver", "RequestRecord", "TransferRecord", "notify",
    ],
    "kvoffload.runtime.scheduling": ["RequestBlocks", "RequestScheduler"],
    "kvoffload.runtime.snapshot": ["EngineSnapshot", "EngineState", "RuntimeStats"],
    "kvoffload.runtime.synthetic": ["SyntheticConfig", "SyntheticWorkload"],
    "kvoffload.runtime.trace": ["DEFAULT_TRACE_BLOCK_SIZE", "TraceWorkload", "load_mooncake_trace"],
    "kvoffload.runtime.workloads": [
        "LoopedWorkload", "Pacer", "Request", "Workload", "WorkloadError", "engine_block_hashes",
        "loop", "paced",
    ],
    "kvoffload.spec": ["CPUOffloadingSpec", "OffloadingConfig", "OffloadingSpec", "available_policies"],
    "kvoffload.stats": [
        "ARC_LISTS", "STORE_OUTCOMES", "ManagerCounters", "ManagerStats", "WindowStats",
    ],
    "kvoffload.table": [
        "IMPLEMENTATION", "NO_TAG", "RESIDENT_TAGS", "STAY", "TAGS", "USE_STRIDE", "BlockTable",
        "PyBlockTable", "TableList", "TouchRules",
    ],
    "kvoffload.transfer": [
        "CpuGpuOffloadingHandler", "OffloadingHandler", "OffloadingWorker", "TransferResult",
        "TransferSpec",
    ],
    "kvoffload.transfer.block_map": [
        "CopyPlan", "Direction", "PartialCPULoadStoreSpec", "TransferPlan", "admit_job",
        "consecutive_runs", "expand_block_ids", "plan_copy", "plan_transfer",
    ],
    "kvoffload.transfer.cpu_gpu": [
        "CpuGpuOffloadingHandler", "default_max_cpu_bytes", "device_copy", "pinned_footprint",
    ],
    "kvoffload.transfer.faults": ["FaultInjectingHandler"],
    "kvoffload.transfer.host_copy": ["HostCopier", "RowPair", "Strategy", "c_copy_rows"],
    "kvoffload.transfer.layout": [
        "LAYOUTS", "AttentionBackendLike", "Layout", "block_dim", "layout_from_backend",
        "resolve_layouts",
    ],
    "kvoffload.transfer.memory": ["InMemoryOffloadingHandler"],
    "kvoffload.transfer.row_kernel": ["MAX_RUN_BYTES", "available", "copy_rows"],
    "kvoffload.transfer.worker": [
        "OffloadingHandler", "OffloadingWorker", "TransferResult", "TransferSpec", "TransferType",
    ],
    "kvoffload.vllm": [
        "EXTRA_CONFIG_KEYS", "HintingScheduler", "KVOffloadSpec", "ReportingHandler",
        "add_transfer_listener", "admin_port", "live_admin_servers", "live_handlers",
        "live_managers", "lookahead", "offloading_config", "row_kernel",
    ],
    "kvoffload.vllm.admin": ["VLLMHostedManager", "serve_admin"],
    "kvoffload.vllm.config": [
        "DEFAULT_LOOKAHEAD", "EXTRA_CONFIG_KEYS", "MAX_LOOKAHEAD", "MAX_PORT", "SPEC_MODULE_PATH",
        "SPEC_NAME",
        "admin_port", "lookahead", "offloading_config", "row_kernel",
    ],
    "kvoffload.vllm.handler": ["ReportingHandler"],
    "kvoffload.vllm.live": [
        "TransferListener", "add_admin_server", "add_handler", "add_manager",
        "add_transfer_listener", "live_admin_servers", "live_handlers", "live_managers", "report",
    ],
    "kvoffload.vllm.scheduler": ["HintingScheduler"],
    "kvoffload.vllm.spec": ["KVOffloadSpec"],
}  # fmt: skip
#: public-looking names a module defines for its own use only
INTERNAL = {"kvoffload.cli": {"UsageError"}}  # the CLI's own signal to print usage


def _public_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) == 1 or any(p.startswith("_") for p in parts):
            continue
        names.append(".".join(parts))
    return names


def test_every_public_module_is_pinned() -> None:
    assert _public_modules() == sorted(EXPORTS)


HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _read_source(name: str) -> tuple[list[str], set[str]]:
    """``__all__`` and the public classes and functions of a module, from its
    source: for the modules that cannot be imported without vLLM."""
    tree = ast.parse((PACKAGE.parent / (name.replace(".", "/") + ".py")).read_text())
    exports: list[str] = []
    defined = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            exports = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            defined.add(node.name)
    return exports, defined


def _exports_and_defined(name: str) -> tuple[list[str], set[str], object | None]:
    if name in NEEDS_VLLM and not HAVE_VLLM:
        exports, defined = _read_source(name)
        return exports, defined, None
    module = importlib.import_module(name)
    defined = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == name
    }
    return list(module.__all__), defined, module


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_module_exports_are_pinned(name: str) -> None:
    exports, _, module = _exports_and_defined(name)
    assert exports == EXPORTS[name]
    if module is None:
        return
    for export in exports:
        if export in FROM_VLLM_SPEC and not HAVE_VLLM:
            continue
        assert hasattr(module, export), f"{name}.__all__ names {export}, which it lacks"


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_module_exports_what_it_defines(name: str) -> None:
    """Each public class and function a module defines is in its ``__all__``."""
    exports, defined, _ = _exports_and_defined(name)
    missing = defined - set(exports) - INTERNAL.get(name, set())
    assert not missing, f"{name} defines {sorted(missing)} but does not export them"
