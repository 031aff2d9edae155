"""kvoffload against vLLM 0.11.2's own code, loaded from its wheel.

* the worker: code written against ``vllm.v1.kv_offload`` routes and reports
  jobs the same way after changing imports only (the managers' answers and
  lists are compared in ``test_programs.py``);
* the defects: each scenario of DESIGN.md section 4 (1-6 and 9) shows the
  defect on vLLM and the fix on kvoffload.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload

from .lockstep import managers


def _both(vllm: Any, kind: str, capacity: int, events: bool = False) -> tuple[Any, Any]:
    return managers(vllm, kind, capacity, events)


OUTCOME = st.sampled_from(["ok", "fail", "refuse", "raise"])
JOB = st.tuples(st.sampled_from(["store", "load"]), OUTCOME, st.booleans())


def _worker(impl: Any) -> Any:
    """A worker with one handler for both directions: it does what each job
    id was scripted to do, and finishes the jobs it accepted when polled."""

    class Scripted(impl.OffloadingHandler):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.script: dict[int, str] = {}
            self.pending: list[tuple[int, bool]] = []

        def transfer_async(self, job_id: int, spec: Any) -> bool:
            outcome = self.script[job_id]
            if outcome == "raise":
                raise RuntimeError(f"job {job_id} broke")
            if outcome == "refuse":
                return False
            self.pending.append((job_id, outcome == "ok"))
            return True

        def get_finished(self) -> list[tuple[int, bool]]:
            done, self.pending = self.pending, []
            return done

    worker, handler = impl.OffloadingWorker(), Scripted()
    worker.register_handler(impl.GPULoadStoreSpec, impl.CPULoadStoreSpec, handler)
    worker.register_handler(impl.CPULoadStoreSpec, impl.GPULoadStoreSpec, handler)
    return worker, handler


@settings(max_examples=200, deadline=None)
@given(jobs=st.lists(JOB, max_size=30))
def test_worker_routes_and_reports_like_vllm(vllm: Any, jobs: list[Any]) -> None:
    """Jobs that succeed, fail, are refused or raise, in both directions,
    with polls in between: the same submissions and the same results."""
    sides = [_worker(vllm), _worker(kvoffload)]
    for job_id, (direction, outcome, poll) in enumerate(jobs):
        answers, finished = [], []
        for impl, (worker, handler) in zip((vllm, kvoffload), sides, strict=True):
            gpu, cpu = impl.GPULoadStoreSpec([job_id]), impl.CPULoadStoreSpec([job_id])
            handler.script[job_id] = outcome
            answers.append(
                worker.transfer_async(job_id, (gpu, cpu) if direction == "store" else (cpu, gpu))
            )
            if poll:
                finished.append(sorted(worker.get_finished()))
        assert answers[0] == answers[1] == (outcome in ("ok", "fail"))
        if poll:
            assert finished[0] == finished[1]
    assert sorted(sides[0][0].get_finished()) == sorted(sides[1][0].get_finished())


# -- the defects, each shown on vLLM and fixed here ----------------------------


def _stored(m: Any, *hashes: bytes) -> None:
    out = m.prepare_store(list(hashes))
    assert out is not None
    m.complete_store(out.block_hashes_to_store)


def test_defect1_arc_touch_of_a_store_in_flight(vllm: Any) -> None:
    for m in _both(vllm, "arc", 4):
        _stored(m, b"1")
        m.prepare_store([b"2"])
        if m.__module__.startswith("vllm"):
            with pytest.raises(KeyError):
                m.touch([b"1", b"2"])  # the engine touches right after prepare_store
        else:
            m.touch([b"1", b"2"])
            assert list(m.t1) == [b"2"] and list(m.t2) == [b"1"]


def test_defect2_arc_failed_store_drops_ready_blocks(vllm: Any) -> None:
    theirs, ours = _both(vllm, "arc", 4)
    for m in (theirs, ours):
        _stored(m, b"1")
        m.prepare_store([b"1", b"2"])
        m.complete_store([b"1", b"2"], success=False)
    # vLLM forgot the ready block 1 without freeing its slot
    assert theirs.lookup([b"1"]) == 0
    assert theirs.backend.get_num_free_blocks() + len(theirs.t1) + len(theirs.t2) == 3
    assert ours.lookup([b"1"]) == 1
    assert ours.backend.get_num_free_blocks() + len(ours.t1) + len(ours.t2) == 4


def test_defect3_arc_evicts_then_gives_up(vllm: Any) -> None:
    theirs, ours = _both(vllm, "arc", 4)
    for m in (theirs, ours):
        _stored(m, b"1", b"2", b"3", b"4")
        m.prepare_load([b"3", b"4"])  # only 1 and 2 evictable
        assert m.prepare_store([b"5", b"6", b"7"]) is None
    assert theirs.lookup([b"1", b"2"]) == 0  # evicted for nothing
    assert ours.lookup([b"1", b"2"]) == 2


def test_defect4_arc_does_not_fall_back_to_t1(vllm: Any) -> None:
    theirs, ours = _both(vllm, "arc", 3)
    for m in (theirs, ours):
        _stored(m, b"1", b"2")
        m.touch([b"1", b"2"])  # both to T2
        m.prepare_load([b"1", b"2"])  # T2 has nothing evictable
        _stored(m, b"3")
        m.target_t1_size = 3.0  # T1 below target: T2 is asked first
    assert theirs.prepare_store([b"4"]) is None
    out = ours.prepare_store([b"4"])
    assert out is not None and out.block_hashes_evicted == [b"3"]


def test_defect5_a_block_named_in_the_call_is_a_victim(vllm: Any) -> None:
    theirs, ours = _both(vllm, "lru", 4)
    for m in (theirs, ours):
        _stored(m, b"1", b"2", b"3", b"4")
    assert theirs.prepare_store([b"1", b"100"]).block_hashes_evicted == [b"1"]
    assert ours.prepare_store([b"1", b"100"]).block_hashes_evicted == [b"2"]


def test_defect6_a_repeated_hash_takes_two_slots(vllm: Any) -> None:
    theirs, ours = _both(vllm, "lru", 4)
    for m in (theirs, ours):
        m.prepare_store([b"5", b"5"])
    assert theirs.backend.get_num_free_blocks() + len(theirs.blocks) == 3  # a slot leaked
    assert ours.backend.get_num_free_blocks() + len(ours) == 4


def test_defect9_events_pile_up_without_bound(vllm: Any) -> None:
    theirs, ours = _both(vllm, "lru", 4, events=True)
    calls = ours.event_log.capacity + 1
    for m in (theirs, ours):
        for i in range(calls):
            _stored(m, b"%d" % i)
    assert len(theirs.events) == 2 * calls - 4  # every store and removal, kept
    stats = ours.event_log.stats()
    assert len(list(ours.take_events())) == ours.event_log.capacity
    assert stats.overwritten == 2 * calls - 4 - ours.event_log.capacity
