"""Every public module of the core library says what it exports (``__all__``),
and what it says is pinned here. ``kvoffload`` itself is pinned in
``test_public_api.py``; ``kvoffload.runtime``, ``kvoffload.transfer`` and
``kvoffload.vllm`` (the adapter for vLLM's engine, where it is merged) are left
to their own tests."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import kvoffload

PACKAGE = Path(kvoffload.__file__).parent
SKIPPED = ("runtime", "transfer", "vllm")

EXPORTS = {
    "kvoffload.abstract": [
        "BlockHash", "LoadStoreSpec", "OffloadingEvent", "OffloadingManager", "PrepareStoreOutput",
        "SupportsHints",
    ],
    "kvoffload.backend": ["Backend", "BlockStatus", "Handle"],
    "kvoffload.backends": ["CPUBackend", "CPUBlockStatus"],
    "kvoffload.backends.cpu": ["CPUBackend", "CPUBlockStatus"],
    "kvoffload.cli": ["main"],
    "kvoffload.errors": [
        "BlockStateError", "ConfigError", "KVOffloadError", "PolicyError", "TransferError",
        "UnknownTicketError",
    ],
    "kvoffload.event_log": [
        "EVENT_KINDS", "EventKind", "EventLog", "EventLogStats", "EventPage", "EventRecord",
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
        "ConfigLabelValue", "KVOffloadCollector", "PrometheusObserver", "SnapshotSource",
        "config_labels",
    ],
    "kvoffload.instrumentation.tracing": [
        "SPAN_NAMES", "Attr", "EvictionLogs", "LogEvent", "TracingObserver",
    ],
    "kvoffload.manager": ["ARCOffloadingManager", "LRUOffloadingManager", "PolicyOffloadingManager"],
    "kvoffload.mediums": ["BlockIDsLoadStoreSpec", "CPULoadStoreSpec", "GPULoadStoreSpec"],
    "kvoffload.policies": [
        "STAY", "EvictionPolicy", "TouchRules", "Victims", "available_policies", "create_policy",
        "policy_class", "register_policy",
    ],
    "kvoffload.policies.arc": ["B1", "B2", "T1", "T2", "ARCList", "ARCPolicy", "TwoListPolicy"],
    "kvoffload.policies.base": ["EvictionPolicy", "Victims"],
    "kvoffload.policies.hkvarc": ["HKVARCPolicy"],
    "kvoffload.policies.kvarc": ["GHOST_FACTOR", "KVARCPolicy"],
    "kvoffload.policies.lru": ["LRU", "LRUList", "LRUPolicy"],
    "kvoffload.replay": [
        "BeladyResult", "ReplayResult", "ReplayTrace", "belady", "parse_capacity", "replay",
    ],
    "kvoffload.spec": ["CPUOffloadingSpec", "OffloadingConfig", "OffloadingSpec", "available_policies"],
    "kvoffload.stats": [
        "ARC_LISTS", "STORE_OUTCOMES", "ManagerCounters", "ManagerStats", "WindowStats",
    ],
    "kvoffload.table": [
        "IMPLEMENTATION", "NO_TAG", "RESIDENT_TAGS", "STAY", "TAGS", "USE_STRIDE", "BlockTable",
        "PyBlockTable", "TableList", "TouchRules",
    ],
}  # fmt: skip
#: public-looking names a module defines for its own use only
INTERNAL = {"kvoffload.cli": {"UsageError"}}  # the CLI's own signal to print usage


def _public_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) == 1 or parts[1] in SKIPPED or any(p.startswith("_") for p in parts):
            continue
        names.append(".".join(parts))
    return names


def test_every_public_module_is_pinned() -> None:
    assert _public_modules() == sorted(EXPORTS)


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_module_exports_are_pinned(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == EXPORTS[name]
    for export in module.__all__:
        assert hasattr(module, export), f"{name}.__all__ names {export}, which it lacks"


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_module_exports_what_it_defines(name: str) -> None:
    """Each public class and function a module defines is in its ``__all__``."""
    module = importlib.import_module(name)
    defined = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == name
    }
    missing = defined - set(module.__all__) - INTERNAL.get(name, set())
    assert not missing, f"{name} defines {sorted(missing)} but does not export them"
