"""The metric catalogue follows the naming contract, the docs list it, and
importing kvoffload does not load any telemetry stack."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import kvoffload.instrumentation as instrumentation
from kvoffload.instrumentation import ALLOWED_LABELS, METRICS, METRICS_BY_NAME
from kvoffload.instrumentation.catalogue import render_markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "observability.md"
NAME = re.compile(r"^kvoffload_[a-z0-9_]+$")


def test_catalogue_names_follow_the_contract() -> None:
    assert len(METRICS_BY_NAME) == len(METRICS), "duplicate metric names"
    for m in METRICS:
        assert NAME.match(m.name), m.name
        assert "__" not in m.name, m.name
        assert ":" not in m.name
        if m.type == "counter":
            assert m.name.endswith("_total"), m.name
        else:
            assert not m.name.endswith("_total"), m.name
        words = m.name.split("_")
        assert not {"ratio", "percent", "rate"} & set(words), f"{m.name}: ratios belong in queries"
        if m.info:
            assert m.name.endswith("_info") and m.type == "gauge", m.name


def test_catalogue_every_metric_has_help() -> None:
    for m in METRICS:
        assert m.help.strip(), m.name
        assert len(m.help) >= 20, f"{m.name}: say what it counts"


def test_catalogue_labels_are_low_cardinality() -> None:
    for m in METRICS:
        if not m.info:
            assert set(m.labels) <= ALLOWED_LABELS, (m.name, m.labels)


def test_catalogue_histograms_have_sorted_buckets() -> None:
    hists = [m for m in METRICS if m.type == "histogram"]
    assert {m.name for m in hists} == {
        "kvoffload_transfer_duration_seconds",
        "kvoffload_transfer_size_bytes",
        "kvoffload_runtime_step_duration_seconds",
        "kvoffload_api_request_duration_seconds",
    }
    for m in hists:
        assert list(m.buckets) == sorted(set(m.buckets)), m.name
    duration = METRICS_BY_NAME["kvoffload_transfer_duration_seconds"].buckets
    assert (duration[0], duration[-1]) == (50e-6, 10.0)
    size = METRICS_BY_NAME["kvoffload_transfer_size_bytes"].buckets
    assert (size[0], size[-1]) == (4 * 1024, 4 * 1024**3)
    assert all(b == a * 4 for a, b in itertools.pairwise(size))


def test_docs_list_every_metric() -> None:
    text = DOC.read_text(encoding="utf-8")
    for m in METRICS:
        assert f"`{m.name}`" in text, f"docs/observability.md does not list {m.name}"


def test_every_block_count_says_which_block_it_counts() -> None:
    # issue 18: "blocks" meant 16-token GPU blocks in the transfer and runtime
    # figures and 64-token offloaded blocks in the manager's, with no unit
    for m in METRICS:
        if "blocks" in m.name:
            text = m.help.lower()
            assert "offloaded block" in text or "gpu block" in text, m.name


def test_docs_table_is_the_generated_one() -> None:
    # Regenerate with: python -c "from kvoffload.instrumentation import
    # render_markdown_table as r; print(r(), end='')"
    assert render_markdown_table() in DOC.read_text(encoding="utf-8")


def test_public_api_is_pinned() -> None:
    assert sorted(instrumentation.__all__) == [
        "ALLOWED_LABELS",
        "KVOffloadCollector",
        "METRICS",
        "METRICS_BY_NAME",
        "MetricSpec",
        "OTelMetricsBridge",
        "PrometheusObserver",
        "TracingObserver",
        "config_labels",
        "render_markdown_table",
    ]
    for name in instrumentation.__all__:
        assert getattr(instrumentation, name) is not None


def test_import_kvoffload_loads_no_telemetry_stack() -> None:
    code = (
        "import sys, kvoffload, kvoffload.runtime.observer, kvoffload.runtime.snapshot\n"
        "bad = [m for m in sys.modules if m.startswith(('prometheus_client', 'opentelemetry',"
        " 'kvoffload.instrumentation'))]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == ""


def test_catalogue_import_needs_no_third_party_package() -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "sys.modules['opentelemetry'] = None\n"
        "from kvoffload.instrumentation import METRICS\n"
        "print(len(METRICS))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert int(out.stdout) == len(METRICS)
