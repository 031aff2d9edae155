"""kvoffload's LRU and ARC against vLLM 0.11.2's, on random programs.

Code written against ``vllm.v1.kv_offload`` must get the same answers from
kvoffload after changing imports only. A Hypothesis state machine drives
both managers in lockstep (``lockstep.py``) with stores that complete at
once, many calls later or fail, loads that stay pinned across evictions,
touches, look-ups, event drains and ARC target changes, and compares every
answer (hits, victims, block ids, events) and every list in order after
every call. Calls that would run into one of vLLM's own defects are left
out, and only those (``lockstep.py`` says how each is recognised).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .lockstep import Lockstep

ALL = [b"h%d" % i for i in range(14)]
HASH = st.sampled_from(ALL)
HASHES = st.lists(HASH, min_size=1, max_size=6)
#: complete the store at once (True), fail it at once (False) or leave it in flight
COMPLETE = st.sampled_from([True, True, False, None, None, None])


class Programs(RuleBasedStateMachine):
    """One random program on both managers of one kind."""

    vllm: Any = None
    kind = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.run: Lockstep

    @initialize(
        capacity=st.integers(1, 8),
        stores=st.lists(st.tuples(HASHES, COMPLETE), min_size=1, max_size=6),
        data=st.data(),
    )
    def start(
        self, capacity: int, stores: list[tuple[list[bytes], bool | None]], data: st.DataObject
    ) -> None:
        """Start busy (Hypothesis favours short programs): stored blocks,
        some in flight, some pinned by loads held from here on."""
        run = self.run = Lockstep(self.vllm, self.kind, capacity)
        for hashes, complete in stores:
            run.store(hashes, complete)
        ready = [h for h in ALL if run.ours.lookup([h])]
        if ready:
            for h in data.draw(st.lists(st.sampled_from(ready), max_size=3)):
                run.load([h], hold=True)

    @rule(hashes=HASHES, complete=COMPLETE)
    def store(self, hashes: list[bytes], complete: bool | None) -> None:
        self.run.store(hashes, complete)

    @rule(data=st.data(), complete=COMPLETE)
    def store_new(self, data: st.DataObject, complete: bool | None) -> None:
        """Store hashes that are not stored: evictions, once the cache is full."""
        new = [h for h in ALL if h not in self.run.ours]
        if new:
            self.run.store(
                data.draw(st.lists(st.sampled_from(new), min_size=1, max_size=4)), complete
            )

    @precondition(lambda self: self.run.stores)
    @rule(
        i=st.integers(0, 7),
        success=st.sampled_from([True, True, True, False]),
        extra=st.lists(HASH, max_size=2),
    )
    def complete_store(self, i: int, success: bool, extra: list[bytes]) -> None:
        self.run.complete_store(i, success, extra)

    @rule(hashes=HASHES, hold=st.sampled_from([True, True, False]))
    def load(self, hashes: list[bytes], hold: bool) -> None:
        self.run.load(hashes, hold)

    @precondition(lambda self: self.run.loads)
    @rule(i=st.integers(0, 7))
    def complete_load(self, i: int) -> None:
        self.run.complete_load(i)

    @rule(hashes=HASHES)
    def touch(self, hashes: list[bytes]) -> None:
        self.run.touch(hashes)

    @rule(hashes=HASHES)
    def lookup(self, hashes: list[bytes]) -> None:
        self.run.lookup(hashes)

    @rule()
    def events(self) -> None:
        self.run.events()

    @precondition(lambda self: self.kind == "arc")
    @rule(value=st.integers(0, 9))
    def set_target(self, value: int) -> None:
        self.run.set_target(float(value))

    @invariant()
    def same_lists(self) -> None:
        self.run.check()

    def teardown(self) -> None:
        run = getattr(self, "run", None)
        if run is None:
            return
        run.events()
        for defect in sorted(run.skipped):
            event(f"{self.kind}: calls left out for vLLM defect {defect}")
        if run.passed_busy:
            event(f"{self.kind}: an eviction passed a busy block")


@pytest.mark.parametrize("kind", ["lru", "arc"])
def test_same_answers_and_lists_as_vllm(vllm: Any, kind: str) -> None:
    machine = type(f"Programs_{kind}", (Programs,), {"vllm": vllm, "kind": kind})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=800,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
