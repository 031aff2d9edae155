"""The engine on the calling thread: live policy switches, failure injection,
data verification, observers and snapshots."""

from __future__ import annotations

from collections.abc import Iterator

from kvoffload.runtime.engine import Engine, EngineConfig
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.workloads import Request, Workload

BLOCK = 64  # tokens per offloaded block = the workloads' trace block size


def small_config(**overrides: object) -> EngineConfig:
    """A tiny model: 2 layers, 1 KV head of 8, 16-token GPU blocks."""
    args: dict[str, object] = {
        "gpu_block_size": 16,
        "offloaded_block_size": BLOCK,
        "num_gpu_blocks": 96,
        "num_cpu_blocks": 48,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_size": 8,
        "max_requests_per_step": 4,
    }
    args.update(overrides)
    return EngineConfig(**args)  # type: ignore[arg-type]


def synthetic(num_requests: int = 200, seed: int = 1) -> SyntheticWorkload:
    """Heavy reuse: few open chats and a small document set."""
    return SyntheticWorkload(
        SyntheticConfig(
            seed=seed,
            num_requests=num_requests,
            trace_block_size=BLOCK,
            open_chats=8,
            num_documents=20,
            document_blocks=(2, 8),
            one_off_blocks=(1, 8),
        )
    )


class CountingWorkload(Workload):
    """Delegates to ``inner`` and counts calls of :meth:`describe`."""

    def __init__(self, inner: Workload) -> None:
        self.inner = inner
        self.trace_block_size = inner.trace_block_size
        self.describe_calls = 0

    def __iter__(self) -> Iterator[Request]:
        return iter(self.inner)

    def describe(self) -> str:
        self.describe_calls += 1
        return self.inner.describe()


# --------------------------------------------------------------------------- snapshots


def test_engine_describes_the_workload_once_not_per_snapshot() -> None:
    # A trace's describe() scans every request: per snapshot it made a replay
    # quadratic in the trace length.
    workload = CountingWorkload(synthetic(num_requests=40))
    engine = Engine(small_config(), workload)
    snap = engine.run()
    assert snap.step >= 10
    assert workload.describe_calls == 1
    assert snap.workload == engine.workload_description == workload.inner.describe()
