"""OffloadingWorker: routing by medium pair, failure paths, get_finished contents."""

from __future__ import annotations

import logging

import pytest

from kvoffload.abstract import LoadStoreSpec
from kvoffload.errors import TransferError
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer.memory import InMemoryOffloadingHandler
from kvoffload.transfer.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)

STORE: TransferSpec = (GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
LOAD: TransferSpec = (CPULoadStoreSpec([0]), GPULoadStoreSpec([1]))


class ScriptedHandler(OffloadingHandler):
    """Records what it is given; answers as scripted."""

    def __init__(self, *, accept: bool = True, raises: bool = False) -> None:
        self.accept = accept
        self.raises = raises
        self.submitted: list[tuple[int, TransferSpec]] = []
        self.polls = 0
        self.ready: list[TransferResult] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self.raises:
            raise RuntimeError("device lost")
        self.submitted.append((job_id, spec))
        return self.accept

    def get_finished(self) -> list[TransferResult]:
        self.polls += 1
        out, self.ready = self.ready, []
        return out


class DiskSpec(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "DISK"


def test_worker_routes_by_medium_pair() -> None:
    stores, loads = ScriptedHandler(), ScriptedHandler()
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, stores)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, loads)
    assert worker.transfer_async(1, STORE)
    assert worker.transfer_async(2, LOAD)
    assert [job for job, _ in stores.submitted] == [1]
    assert [job for job, _ in loads.submitted] == [2]
    assert stores.submitted[0][1] is STORE


def test_worker_polls_a_handler_registered_twice_once() -> None:
    both, other = ScriptedHandler(), ScriptedHandler()
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, both)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, both)
    worker.register_handler(GPULoadStoreSpec, DiskSpec, other)
    assert worker.handlers == [both, other]
    worker.get_finished()
    assert (both.polls, other.polls) == (1, 1)


def test_worker_get_finished_merges_handlers_and_reports_once() -> None:
    a, b = ScriptedHandler(), ScriptedHandler()
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, a)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, b)
    assert worker.transfer_async(1, STORE)
    assert worker.transfer_async(2, LOAD)
    assert worker.transfer_async(3, STORE)
    a.ready = [(3, False), (1, True)]
    b.ready = [(2, True)]
    assert worker.get_finished() == [(3, False), (1, True), (2, True)]
    assert worker.get_finished() == []


def test_worker_returns_false_and_logs_when_handler_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, ScriptedHandler(raises=True))
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.worker"):
        assert worker.transfer_async(9, STORE) is False
    assert "transfer 9 (GPU->CPU) raised" in caplog.text
    assert "device lost" in caplog.text  # the traceback is attached
    # the job was never in flight, so its id is free
    worker.transfer_type_to_handler[("GPU", "CPU")] = ScriptedHandler()
    assert worker.transfer_async(9, STORE)


def test_worker_returns_false_and_logs_when_handler_refuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = ScriptedHandler(accept=False)
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.worker"):
        assert worker.transfer_async(4, STORE) is False
    assert "transfer 4 (GPU->CPU) was refused by its handler" in caplog.text
    handler.accept = True
    assert worker.transfer_async(4, STORE)


def test_worker_unregistered_pair_is_a_transfer_error() -> None:
    worker = OffloadingWorker()
    with pytest.raises(
        TransferError, match=r"no handler registered for GPU->CPU \(registered: none\)"
    ):
        worker.transfer_async(1, STORE)
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, ScriptedHandler())
    with pytest.raises(TransferError, match=r"CPU->GPU \(registered: GPU->CPU\)"):
        worker.transfer_async(1, LOAD)


class OddMediumSpec(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return 5  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("spec", "got"),
    [
        # once a raw ValueError (unpacking) or AttributeError (no medium)
        ((GPULoadStoreSpec([0]),), "got a tuple (GPULoadStoreSpec): not enough values"),
        ((*STORE, CPULoadStoreSpec([1])), "got a tuple (GPULoadStoreSpec, CPULoadStoreSpec, "),
        ((object(), CPULoadStoreSpec([0])), "got a tuple (object, CPULoadStoreSpec): 'object'"),
        (GPULoadStoreSpec([0]), "got a GPULoadStoreSpec: "),
        (None, "got a NoneType: "),
        (
            (GPULoadStoreSpec([0]), OddMediumSpec()),
            "got a tuple (GPULoadStoreSpec, OddMediumSpec): medium() answered 'GPU', 5",
        ),
    ],
)
def test_worker_malformed_spec_pair_is_a_transfer_error(spec: object, got: str) -> None:
    handler = ScriptedHandler()
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    with pytest.raises(TransferError) as raised:
        worker.transfer_async(1, spec)  # type: ignore[arg-type]
    message = str(raised.value)
    assert message.startswith(
        "a spec pair must be a (src, dst) tuple of two LoadStoreSpecs whose medium() is a string"
    )
    assert got in message
    assert handler.submitted == []
    assert worker.transfer_async(1, STORE)


def test_worker_job_id_in_flight_is_a_transfer_error() -> None:
    handler = ScriptedHandler()
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handler)
    assert worker.transfer_async(1, STORE)
    with pytest.raises(TransferError, match="job id 1 is still in flight"):
        worker.transfer_async(1, LOAD)
    handler.ready = [(1, False)]  # failed jobs free their id as well
    assert worker.get_finished() == [(1, False)]
    assert worker.transfer_async(1, LOAD)


def test_worker_duplicate_registration_is_a_transfer_error() -> None:
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, ScriptedHandler())
    with pytest.raises(TransferError, match="already registered for GPU->CPU"):
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, ScriptedHandler())


def test_worker_with_in_memory_handler_reports_job_failures() -> None:
    handler = InMemoryOffloadingHandler(fail_job_ids=[2], delay_polls=1)
    handler.write_gpu_block(0, b"kv")
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handler)
    assert worker.transfer_async(1, STORE)
    assert worker.transfer_async(2, (GPULoadStoreSpec([0]), CPULoadStoreSpec([5])))
    assert worker.get_finished() == []
    assert worker.get_finished() == [(1, True), (2, False)]
    assert handler.read_cpu_block(0) == [b"kv"]
    assert handler.read_cpu_block(5) == [None]
    assert worker.transfer_async(3, LOAD)
    worker.get_finished()
    assert worker.get_finished() == [(3, True)]
    assert handler.read_gpu_block(1) == b"kv"
