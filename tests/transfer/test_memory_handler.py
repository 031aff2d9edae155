"""InMemoryOffloadingHandler: copies like the real handler, injects failures and delays."""

from __future__ import annotations

import logging
import re

import pytest

from kvoffload.errors import ConfigError
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer.block_map import PartialCPULoadStoreSpec
from kvoffload.transfer.memory import InMemoryOffloadingHandler


def filled(factor: int = 1, **kwargs: object) -> InMemoryOffloadingHandler:
    h = InMemoryOffloadingHandler(block_size_factor=factor, **kwargs)  # type: ignore[arg-type]
    for i in range(12):
        h.write_gpu_block(i, f"gpu{i}".encode())
    return h


def test_memory_handler_store_then_load_round_trip() -> None:
    h = filled(factor=3)
    assert h.transfer_async(1, (GPULoadStoreSpec([4, 5, 6, 7, 8]), CPULoadStoreSpec([2, 0])))
    assert h.get_finished() == [(1, True)]
    # 5 GPU blocks into 2 CPU blocks of 3: the first sub-block of block 2 is skipped
    assert h.read_cpu_block(2) == [None, b"gpu4", b"gpu5"]
    assert h.read_cpu_block(0) == [b"gpu6", b"gpu7", b"gpu8"]
    # load from the middle of block 2 (defect 7 shape)
    assert h.transfer_async(2, (CPULoadStoreSpec([2, 0]), GPULoadStoreSpec([0, 1, 2, 3])))
    assert h.get_finished() == [(2, True)]
    assert [h.read_gpu_block(i) for i in range(4)] == [b"gpu5", b"gpu6", b"gpu7", b"gpu8"]


def test_memory_handler_partial_spec_ends_inside_a_block() -> None:
    h = filled(factor=3)
    spec = PartialCPULoadStoreSpec([1], skip_last=1)
    assert h.transfer_async(1, (GPULoadStoreSpec([9, 10]), spec))
    assert h.get_finished() == [(1, True)]
    assert h.read_cpu_block(1) == [b"gpu9", b"gpu10", None]


def test_memory_handler_reads_source_at_submit() -> None:
    h = filled(delay_polls=1)
    assert h.transfer_async(1, (GPULoadStoreSpec([3]), CPULoadStoreSpec([0])))
    h.write_gpu_block(3, b"overwritten after submit")
    assert h.get_finished() == []
    assert h.read_cpu_block(0) == [None]  # nothing lands before completion
    assert h.get_finished() == [(1, True)]
    assert h.read_cpu_block(0) == [b"gpu3"]


def test_memory_handler_delay_counts_polls_per_job() -> None:
    h = filled(delay_polls=2)
    h.delay_job(2, 0)
    assert h.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert h.transfer_async(2, (GPULoadStoreSpec([1]), CPULoadStoreSpec([1])))
    assert h.num_in_flight == 2
    assert h.get_finished() == [(2, True)]
    assert h.get_finished() == []
    assert h.get_finished() == [(1, True)]
    assert h.get_finished() == []
    assert h.num_in_flight == 0


def test_memory_handler_fail_job_writes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    h = filled(fail_job_ids=[5])
    with caplog.at_level(logging.INFO, logger="kvoffload.transfer.memory"):
        assert h.transfer_async(5, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
        assert h.get_finished() == [(5, False)]
    assert "transfer 5 failed (injected)" in caplog.text
    assert h.read_cpu_block(0) == [None]
    # one-shot: the same id succeeds when submitted again
    assert h.transfer_async(5, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert h.get_finished() == [(5, True)]
    h.fail_job(6)
    assert h.transfer_async(6, (GPULoadStoreSpec([1]), CPULoadStoreSpec([1])))
    assert h.get_finished() == [(6, False)]


def test_memory_handler_failure_rate_is_seeded() -> None:
    def outcomes(seed: int) -> list[bool]:
        h = filled(failure_rate=0.5, seed=seed)
        for job in range(40):
            assert h.transfer_async(job, (GPULoadStoreSpec([job % 12]), CPULoadStoreSpec([job])))
        return [ok for _, ok in h.get_finished()]

    first = outcomes(7)
    assert first == outcomes(7)
    assert 5 < first.count(False) < 35
    assert first != outcomes(8)


def test_memory_handler_refusals() -> None:
    h = filled(refuse_job_ids=[1])
    spec = (GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    assert h.transfer_async(1, spec) is False
    assert h.transfer_async(1, spec)  # one-shot
    h.refuse_job(2)
    assert h.transfer_async(2, spec) is False
    h.refuse_all = True
    assert h.transfer_async(3, spec) is False
    assert h.get_finished() == [(1, True)]
    assert h.submitted == [(1, "store", 1)]


def test_memory_handler_refuses_malformed_and_duplicate_jobs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = filled(factor=2, num_gpu_blocks=12, num_cpu_blocks=4, delay_polls=1)
    with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.memory"):
        assert not h.transfer_async(1, (GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0])))
        assert not h.transfer_async(2, (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([4])))
        assert not h.transfer_async(3, (GPULoadStoreSpec([0]), GPULoadStoreSpec([1])))
        assert h.transfer_async(4, (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0])))
        assert not h.transfer_async(4, (GPULoadStoreSpec([2, 3]), CPULoadStoreSpec([1])))
    assert caplog.text.count("refused") == 4
    assert "job id still in flight" in caplog.text


def test_memory_handler_strict_refuses_unwritten_source() -> None:
    h = InMemoryOffloadingHandler()
    spec = (CPULoadStoreSpec([3]), GPULoadStoreSpec([0]))
    assert h.transfer_async(1, spec) is False
    lenient = InMemoryOffloadingHandler(strict=False)
    lenient.write_gpu_block(0, b"stale")
    assert lenient.transfer_async(1, spec)
    assert lenient.get_finished() == [(1, True)]
    assert lenient.read_gpu_block(0) is None  # undefined data reads as absent


def test_memory_handler_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="block_size_factor"):
        InMemoryOffloadingHandler(block_size_factor=0)
    with pytest.raises(ConfigError, match="failure_rate"):
        InMemoryOffloadingHandler(failure_rate=1.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # each once accepted: True failed every job, "2" raised in get_finished
        # with the job stuck, 2.0 and "8" made every job a refusal
        ({"failure_rate": True}, "failure_rate must be a number in [0, 1], got True"),
        ({"failure_rate": "0.5"}, "failure_rate must be a number in [0, 1], got '0.5'"),
        ({"failure_rate": float("nan")}, "failure_rate must be a number in [0, 1], got nan"),
        ({"delay_polls": "2"}, "delay_polls must be an int >= 0, got '2'"),
        ({"delay_polls": -1}, "delay_polls must be an int >= 0, got -1"),
        ({"delay_polls": 1.0}, "delay_polls must be an int >= 0, got 1.0"),
        ({"block_size_factor": 2.0}, "block_size_factor must be an int >= 1, got 2.0"),
        ({"block_size_factor": True}, "block_size_factor must be an int >= 1, got True"),
        ({"num_gpu_blocks": "8"}, "num_gpu_blocks must be None or an int >= 1, got '8'"),
        ({"num_cpu_blocks": 8.0}, "num_cpu_blocks must be None or an int >= 1, got 8.0"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks must be None or an int >= 1, got 0"),
        ({"seed": "1"}, "seed must be an int, got '1'"),
        ({"strict": "no"}, "strict must be True or False, got 'no'"),
        ({"refuse_all": 1}, "refuse_all must be True or False, got 1"),
    ],
)
def test_memory_handler_refuses_settings_of_the_wrong_type(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        InMemoryOffloadingHandler(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("polls", ["2", -1, 1.5, None])
def test_memory_handler_delay_job_refuses_a_bad_count(polls: object) -> None:
    h = InMemoryOffloadingHandler(strict=False)
    with pytest.raises(ConfigError, match=re.escape(f"polls must be an int >= 0, got {polls!r}")):
        h.delay_job(1, polls)  # type: ignore[arg-type]
    assert h.transfer_async(1, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert h.get_finished() == [(1, True)]
