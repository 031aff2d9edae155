"""FaultInjectingHandler turns a seeded fraction of a real handler's jobs into
failures, and nothing else."""

from __future__ import annotations

import re

import pytest

from kvoffload.errors import ConfigError
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer.faults import FaultInjectingHandler
from kvoffload.transfer.memory import InMemoryOffloadingHandler


def _store(i: int) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    return GPULoadStoreSpec([i]), CPULoadStoreSpec([i])


def _run(handler: FaultInjectingHandler, jobs: int) -> dict[int, bool]:
    for j in range(jobs):
        assert handler.transfer_async(j, _store(j))
    return dict(handler.get_finished())


def _inner() -> InMemoryOffloadingHandler:
    return InMemoryOffloadingHandler(num_gpu_blocks=64, num_cpu_blocks=64, strict=False)


def test_rate_zero_and_one() -> None:
    assert all(_run(FaultInjectingHandler(_inner(), 0.0), 20).values())
    assert not any(_run(FaultInjectingHandler(_inner(), 1.0), 20).values())


def test_seeded_fraction_is_reproducible_and_reported_once() -> None:
    a = _run(FaultInjectingHandler(_inner(), 0.5, seed=7), 64)
    b = _run(FaultInjectingHandler(_inner(), 0.5, seed=7), 64)
    assert a == b and len(a) == 64
    assert 10 < sum(not ok for ok in a.values()) < 54
    handler = FaultInjectingHandler(_inner(), 0.5, seed=7)
    _run(handler, 8)
    assert handler.get_finished() == []


def test_refusals_pass_through_and_are_never_reported() -> None:
    inner = _inner()
    inner.refuse_all = True
    handler = FaultInjectingHandler(inner, 1.0)
    assert handler.transfer_async(1, _store(1)) is False
    assert handler.get_finished() == []


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), float("inf")])
def test_rate_outside_the_unit_interval_is_refused(rate: float) -> None:
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        FaultInjectingHandler(_inner(), rate)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # True once failed every job, "0.5" raised a raw TypeError
        ((True,), "failure rate must be a number in [0, 1], got True"),
        (("0.5",), "failure rate must be a number in [0, 1], got '0.5'"),
        ((None,), "failure rate must be a number in [0, 1], got None"),
        ((0.5, 1.5), "seed must be an int, got 1.5"),
        ((0.5, "7"), "seed must be an int, got '7'"),
    ],
)
def test_settings_of_the_wrong_type_are_refused(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        FaultInjectingHandler(_inner(), *args)  # type: ignore[arg-type]


def test_inner_must_be_a_handler_duck_typed_or_not() -> None:
    with pytest.raises(ConfigError, match=r"inner must be a handler .*, got a bool"):
        FaultInjectingHandler(True, 0.5)  # type: ignore[arg-type]

    class Duck:  # not kvoffload's OffloadingHandler (vLLM's, say): taken, as the worker takes it
        def __init__(self) -> None:
            self.inner = _inner()

        def transfer_async(self, job_id: int, spec: object) -> bool:
            return self.inner.transfer_async(job_id, spec)  # type: ignore[arg-type]

        def get_finished(self) -> list[tuple[int, bool]]:
            return self.inner.get_finished()

    assert FaultInjectingHandler(Duck(), 0.5).rate == 0.5  # type: ignore[arg-type]
