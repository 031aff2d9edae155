"""The whole manager protocol against a reference model, under Hypothesis.

The model knows, per hash, whether the block is in flight or ready and how
many loads pin it. It cannot know which victim a policy picks, so it checks
each eviction instead (only ready, unpinned blocks not named in the call) and
whether ``prepare_store`` had to say ``None`` (exactly when there are not
enough such blocks). A policy may decline the tail of a store that would
evict, only while the hint window holds requests (``hkvarc``): the store is
then checked for the prefix it kept. Events are counted from a cursor read
of the event log.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload import BlockHash, BlockStateError, CPUBackend, PolicyOffloadingManager
from kvoffload.policies import available_policies

from .fakes import bh, ids_of

UNIVERSE = [bh(i) for i in range(12)]
hash_lists = st.lists(st.sampled_from(UNIVERSE), max_size=6)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: PolicyOffloadingManager | None = None
        self.capacity = 0
        self.ready: dict[BlockHash, int] = {}  # hash -> pin count
        self.in_flight: set[BlockHash] = set()
        self.cursor = 0
        self.event_balance: Counter[BlockHash] = Counter()
        self.loads: list[list[BlockHash]] = []  # prepare_load calls not yet completed
        self.tickets: list[int] = []  # in the hint window

    @property
    def mgr(self) -> PolicyOffloadingManager:
        assert self.m is not None
        return self.m

    @initialize(capacity=st.integers(1, 8), policy=st.sampled_from(available_policies()))
    def start(self, capacity: int, policy: str) -> None:
        self.capacity = capacity
        self.m = PolicyOffloadingManager(
            CPUBackend(16, capacity), policy=policy, enable_events=True, event_log_capacity=100_000
        )

    def _model_state(self) -> dict[BlockHash, int]:
        state = {h: -1 for h in self.in_flight}
        state.update(self.ready)
        return state

    def _actual_state(self) -> dict[BlockHash, tuple[int, int]]:
        get_block = self.mgr.get_block
        return {
            h: (get_block(h).ref_cnt, handle)  # type: ignore[union-attr]
            for h, handle in self.mgr.policy.ordered_items()
        }

    # -- rules ------------------------------------------------------------

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        self.mgr.touch(self._draw_hashes(data))

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        hashes = self._draw_hashes(data)
        expected = 0
        for h in hashes:
            if h not in self.ready:
                break
            expected += 1
        assert self.mgr.lookup(hashes) == expected

    def _draw_hashes(
        self, data: st.DataObject, preferred: list[BlockHash] | None = None, max_size: int = 6
    ) -> list[BlockHash]:
        """Hashes mostly from ``preferred`` (default: every known block), so that
        calls hit, pin and protect; one in four from the whole universe."""
        if preferred is None:
            preferred = sorted(self.ready) + sorted(self.in_flight)
        element = st.sampled_from(UNIVERSE)
        if preferred:
            pick = st.sampled_from(preferred)
            element = st.one_of(pick, pick, pick, element)
        return data.draw(st.lists(element, max_size=max_size))

    @rule(data=st.data())
    def prepare_store(self, data: st.DataObject) -> None:
        self._prepare_store(self._draw_hashes(data))

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        """prepare_store + complete_store: builds up ready blocks quickly."""
        out = self._prepare_store(self._draw_hashes(data))
        if out:
            self.mgr.complete_store(out)
            for h in out:
                self.in_flight.discard(h)
                self.ready[h] = 0

    def _prepare_store(self, hashes: list[BlockHash]) -> list[BlockHash]:
        named = dict.fromkeys(hashes)
        new = [h for h in named if h not in self.ready and h not in self.in_flight]
        free = self.capacity - len(self.ready) - len(self.in_flight)
        evictable = {h for h, pins in self.ready.items() if pins == 0 and h not in named}
        need = len(new) - free
        before = self._actual_state()
        out = self.mgr.prepare_store(hashes)
        if out is not None and out.block_hashes_to_store != new:
            kept = out.block_hashes_to_store
            assert need > 0 and self.tickets, "declined a store with no need or no hints"
            assert kept == new[: len(kept)], "kept more than a prefix of the absent blocks"
            new = kept
            need = len(new) - free
        if need > len(evictable):
            assert out is None
            assert self._actual_state() == before
            return []
        assert out is not None
        assert len(out.block_hashes_evicted) == max(0, need)
        assert len(set(out.block_hashes_evicted)) == len(out.block_hashes_evicted)
        for h in out.block_hashes_evicted:
            assert h in evictable, f"evicted {h!r}: pinned, in flight, named or absent"
            del self.ready[h]
        ids = ids_of(out.store_spec)
        assert len(ids) == len(new) == len(set(ids))
        self.in_flight.update(new)
        return new

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        if not self.in_flight and not self.ready:
            return
        hashes = self._draw_hashes(data, sorted(self.in_flight) or sorted(self.ready), 4)
        hashes = [h for h in hashes if h in self.in_flight or h in self.ready]
        self.mgr.complete_store(hashes, success=success)
        for h in hashes:
            if h in self.in_flight:
                self.in_flight.discard(h)
                if success:
                    self.ready[h] = 0

    @rule(hashes=hash_lists, success=st.booleans())
    def complete_store_of_unknown(self, hashes: list[BlockHash], success: bool) -> None:
        unknown = [h for h in UNIVERSE if h not in self.ready and h not in self.in_flight]
        if not unknown:
            return
        before = self._actual_state()
        try:
            self.mgr.complete_store([*hashes, unknown[0]], success=success)
        except BlockStateError:
            pass
        else:
            raise AssertionError("complete_store of a never-prepared block must raise")
        assert self._actual_state() == before

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        hashes = self._draw_hashes(data, sorted(self.ready), max_size=3)
        if hashes and data.draw(st.booleans()):
            hashes.append(hashes[0])  # a hash listed twice pins twice
        if all(h in self.ready for h in hashes):
            spec = self.mgr.prepare_load(hashes)
            actual = self._actual_state()
            assert ids_of(spec) == [actual[h][1] for h in hashes]
            for h in hashes:
                self.ready[h] += 1
            self.loads.append(hashes)
        else:
            before = self._actual_state()
            try:
                self.mgr.prepare_load(hashes)
            except BlockStateError:
                pass
            else:
                raise AssertionError("prepare_load of an absent or in-flight block must raise")
            assert self._actual_state() == before

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        """Finish one of the loads in progress (what an engine does)."""
        if not self.loads:
            return
        hashes = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.mgr.complete_load(hashes)
        for h in hashes:
            self.ready[h] -= 1

    @rule(data=st.data())
    def complete_load_of_unpinned(self, data: st.DataObject) -> None:
        pinned = sorted(h for h, pins in self.ready.items() if pins > 0)
        hashes = self._draw_hashes(data, pinned, max_size=3)
        wanted = Counter(hashes)
        if not hashes or all(self.ready.get(h, 0) >= n for h, n in wanted.items()):
            return  # a valid call: complete_load covers those
        before = self._actual_state()
        try:
            self.mgr.complete_load(hashes)
        except BlockStateError:
            pass
        else:
            raise AssertionError("complete_load of an unpinned block must raise")
        assert self._actual_state() == before

    @rule(data=st.data())
    def hint(self, data: st.DataObject) -> None:
        self.tickets.append(self.mgr.hint(self._draw_hashes(data)))

    @rule(data=st.data())
    def unhint(self, data: st.DataObject) -> None:
        if self.tickets:
            self.mgr.unhint(self.tickets.pop(data.draw(st.integers(0, len(self.tickets) - 1))))

    @rule(policy=st.sampled_from(available_policies()))
    def switch_policy(self, policy: str) -> None:
        before = self._actual_state()
        counters = self.mgr.stats().counters
        same = self.mgr.policy_name == policy
        old = self.mgr.policy
        self.mgr.switch_policy(policy)
        assert self.mgr.policy_name == policy
        assert self._actual_state() == before
        after = self.mgr.stats().counters
        # to the policy in use: nothing at all (its object, ghosts and all, stays)
        assert (self.mgr.policy is old) == same
        assert after.policy_switches == counters.policy_switches + (not same)
        assert after.store_blocks == counters.store_blocks
        assert sum(after.ghost_hits.values()) == sum(counters.ghost_hits.values())

    @rule(fraction=st.floats(0, 1))
    def set_target_t1_size(self, fraction: float) -> None:
        """Steer ARC's choice of list (a knob only adaptive policies have)."""
        policy = self.mgr.policy
        if hasattr(policy, "target_t1_size"):
            policy.target_t1_size = fraction * self.capacity

    @rule()
    def clear(self) -> None:
        evicted = self.mgr.clear()
        expected = {h for h, pins in self.ready.items() if pins == 0}
        assert len(evicted) == len(expected) and set(evicted) == expected
        for h in evicted:
            del self.ready[h]

    # -- invariants -------------------------------------------------------

    @invariant()
    def stats_match_the_model(self) -> None:
        if self.m is None:
            return
        s = self.m.stats()
        assert s.used + s.free == s.capacity == self.capacity
        assert s.used == len(self.ready) + len(self.in_flight) == len(self.m)
        assert s.in_flight == len(self.in_flight)
        assert s.pinned == sum(1 for pins in self.ready.values() if pins > 0)
        assert sum(s.resident_lists.values()) == s.used
        assert s.window.requests == len(self.tickets)

    @invariant()
    def blocks_match_the_model(self) -> None:
        if self.m is None:
            return
        actual = self._actual_state()
        assert {h: ref for h, (ref, _) in actual.items()} == self._model_state()
        ids = [block_id for _, block_id in actual.values()]
        assert len(set(ids)) == len(ids)
        assert all(0 <= i < self.capacity for i in ids)

    @invariant()
    def events_balance_to_the_ready_blocks(self) -> None:
        if self.m is None:
            return
        log = self.m.event_log
        assert log is not None
        page = log.read(after_seq=self.cursor)
        assert page.missed == 0
        for record in page.records:
            assert record.seq == self.cursor + 1
            self.cursor = record.seq
            sign = {"stored": 1, "removed": -1}.get(record.kind, 0)
            for h in record.block_hashes:
                self.event_balance[h] += sign
                assert self.event_balance[h] in (0, 1)
        assert page.next_after_seq == self.cursor
        resident_ready = {h for h, n in self.event_balance.items() if n == 1}
        assert resident_ready == set(self.ready)
        assert sum(self.event_balance.values()) == len(self.ready)


ManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_manager_state_machine = ManagerMachine.TestCase
