"""Fixtures of the instrumentation tests: fresh registries, in-memory OTel
SDK pipelines, small managers and engines on CPU tensors.

The SDK is used here only to look at what the library emits; nothing sets a
global provider or registers on the global Prometheus registry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler
from prometheus_client import CollectorRegistry

from kvoffload import BlockHash, CPUBackend, PolicyOffloadingManager

BLOCK_SIZE = 16


def bh(i: int) -> BlockHash:
    return BlockHash(b"blk%d" % i)


def bhs(ids: range | list[int]) -> list[BlockHash]:
    return [bh(i) for i in ids]


def make_manager(policy: str = "lru", capacity: int = 32) -> PolicyOffloadingManager:
    return PolicyOffloadingManager(
        CPUBackend(block_size=BLOCK_SIZE, num_blocks=capacity), policy=policy, enable_events=True
    )


def store(m: PolicyOffloadingManager, ids: range | list[int]) -> None:
    out = m.prepare_store(bhs(ids))
    assert out is not None
    m.complete_store(out.block_hashes_to_store)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@dataclass
class OTel:
    """An SDK pipeline exporting synchronously into memory."""

    tracer_provider: TracerProvider
    logger_provider: LoggerProvider
    spans: InMemorySpanExporter
    logs: InMemoryLogRecordExporter


def make_otel(sampler: Sampler = ALWAYS_ON) -> OTel:
    spans = InMemorySpanExporter()
    tp = TracerProvider(sampler=sampler, shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    logs = InMemoryLogRecordExporter()  # type: ignore[no-untyped-call]
    lp = LoggerProvider(shutdown_on_exit=False)
    lp.add_log_record_processor(SimpleLogRecordProcessor(logs))
    return OTel(tp, lp, spans, logs)


@pytest.fixture
def otel() -> Iterator[OTel]:
    o = make_otel()
    yield o
    o.tracer_provider.shutdown()
    o.logger_provider.shutdown()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* variable set (for app.telemetry's tests, which read them)."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    return monkeypatch
