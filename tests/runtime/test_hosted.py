"""HostedManager: the host's calls delegate, admin commands land between them,
never during one, and promptly when the host is idle."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from kvoffload import BlockHash, CPUBackend, PolicyOffloadingManager
from kvoffload.errors import PolicyError, UnknownTicketError
from kvoffload.runtime import (
    CommandResult,
    EngineObserver,
    EngineStoppedError,
    HostedManager,
    UnsupportedCommandError,
    VersionConflictError,
)


class ExclusiveManager(PolicyOffloadingManager):
    """Records any moment at which two threads are inside the manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inside = 0
        self.overlaps = 0
        self.threads: set[int] = set()

    def _enter(self) -> None:
        self.inside += 1
        if self.inside > 1:
            self.overlaps += 1
        self.threads.add(threading.get_ident())
        time.sleep(0)  # invite a thread switch right here

    def _leave(self) -> None:
        time.sleep(0)
        self.inside -= 1


def _exclusive(name: str) -> Any:
    method = getattr(PolicyOffloadingManager, name)

    def wrapper(self: ExclusiveManager, *args: Any, **kwargs: Any) -> Any:
        self._enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._leave()

    return wrapper


for _name in (
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "take_events",
    "stats",
    "switch_policy",
    "clear",
    "hint",
    "unhint",
):
    setattr(ExclusiveManager, _name, _exclusive(_name))


def hashes(*ids: int) -> list[BlockHash]:
    return [BlockHash(f"block-{i}".encode()) for i in ids]


def make(capacity: int = 16) -> tuple[ExclusiveManager, HostedManager]:
    manager = ExclusiveManager(
        CPUBackend(block_size=16, num_blocks=capacity), policy="lru", enable_events=True
    )
    return manager, HostedManager(manager)


def test_verbs_delegate_and_the_snapshot_follows() -> None:
    _, hosted = make()
    out = hosted.prepare_store(hashes(1, 2))
    assert out is not None and out.block_hashes_to_store == hashes(1, 2)
    hosted.complete_store(hashes(1, 2))
    assert hosted.lookup(hashes(1, 2, 3)) == 2
    hosted.touch(hashes(1))
    spec = hosted.prepare_load(hashes(1))
    assert list(spec.block_ids) == [0]  # type: ignore[attr-defined]
    hosted.complete_load(hashes(1))
    assert len(hosted) == 2 and hashes(1)[0] in hosted
    status = hosted.get_block(hashes(2)[0])
    assert status is not None and status.ref_cnt == 0
    assert [e.removed for e in hosted.take_events()] == [False]
    assert hosted.stats().used == 2
    hosted.snapshot_max_age = 0.0
    snap = hosted.snapshot()
    assert snap.manager.used == 2 and snap.state == "running"
    assert snap.step == 11  # the host's calls so far


def test_command_on_an_idle_host_is_applied_at_once() -> None:
    _, hosted = make()
    result = hosted.switch_policy("arc").result(timeout=1)
    assert (result.policy, result.policy_version, result.kind) == ("arc", 2, "switch_policy")
    assert result.detail == {"from": "lru", "to": "arc"}
    # published before the future resolved: the next read shows it
    assert hosted.snapshot().manager.policy == "arc"
    assert hosted.snapshot().policy_version == 2
    with pytest.raises(VersionConflictError):
        hosted.switch_policy("lru", expected_version=1).result(timeout=1)
    with pytest.raises(PolicyError):
        hosted.switch_policy("fifo")
    hosted.prepare_store(hashes(1))
    hosted.complete_store(hashes(1))
    reset = hosted.reset().result(timeout=1)
    assert reset.detail == {"cpu_blocks_evicted": "1"}
    assert hosted.lookup(hashes(1)) == 0


def test_command_during_a_host_call_waits_for_its_end() -> None:
    manager, hosted = make()
    in_call = threading.Event()
    release = threading.Event()
    submitted: list[Future[CommandResult]] = []

    def slow_lookup(block_hashes: Any) -> int:
        in_call.set()
        assert release.wait(5)
        assert manager.policy_name == "lru", "a command ran during the call"
        return 0

    host = threading.Thread(target=lambda: hosted._call(slow_lookup, []))
    host.start()
    assert in_call.wait(5)
    submitted.append(hosted.switch_policy("arc"))
    time.sleep(0.05)
    assert not submitted[0].done()
    release.set()
    host.join(5)
    # applied as the call returned, without a later call
    assert submitted[0].result(timeout=1).policy == "arc"


def stored(hosted: HostedManager, *ids: int) -> list[BlockHash]:
    chain = hashes(*ids)
    hosted.prepare_store(chain)
    hosted.complete_store(chain)
    return chain


def test_reset_waits_for_the_load_of_an_outstanding_lookup() -> None:
    """vLLM's scheduler calls prepare_load for what lookup found right after
    it: a reset arriving in between would evict those blocks and make the
    load fail. It is applied once the load has pinned them."""
    _, hosted = make()
    chain = stored(hosted, 1, 2)
    stored(hosted, 3)
    assert hosted.lookup(chain) == 2
    reset = hosted.reset()  # the host is idle, between its lookup and its load
    assert not reset.done()
    assert hosted.stats().used == 3  # a query is not the host's next call
    assert not reset.done()
    hosted.prepare_load(chain)  # would raise had the reset evicted them
    assert reset.result(timeout=1).detail == {"cpu_blocks_evicted": "1"}  # block 3
    hosted.complete_load(chain)
    assert hosted.lookup(chain) == 2


def test_reset_after_a_lookup_the_host_dropped_lands_after_its_next_call() -> None:
    """vLLM drops a lookup's answer when the request gets no GPU blocks: its
    next call is another request's touch, and the reset lands after it."""
    _, hosted = make()
    chain = stored(hosted, 1, 2)
    assert hosted.lookup(chain) == 2
    reset = hosted.reset()
    hosted.touch(hashes(7))
    assert reset.result(timeout=1).detail == {"cpu_blocks_evicted": "2"}
    assert hosted.lookup(chain) == 0


def test_reset_after_a_lookup_that_found_nothing_is_applied_at_once() -> None:
    _, hosted = make()
    stored(hosted, 1)
    assert hosted.lookup(hashes(5)) == 0
    assert hosted.reset().result(timeout=1).detail == {"cpu_blocks_evicted": "1"}


def test_policy_switch_is_not_held_by_an_outstanding_lookup() -> None:
    """A switch keeps every block: it needs no hold, and one queued behind a
    held reset waits for it only (commands keep their order)."""
    _, hosted = make()
    chain = stored(hosted, 1, 2)
    assert hosted.lookup(chain) == 2
    assert hosted.switch_policy("arc").result(timeout=1).policy == "arc"
    reset, switch = hosted.reset(), hosted.switch_policy("lru")
    assert not reset.done() and not switch.done()
    hosted.prepare_load(chain)
    assert reset.result(timeout=1).kind == "reset"
    assert switch.result(timeout=1).policy == "lru"
    hosted.complete_load(chain)


def test_hints_delegate_and_leave_a_lookups_answer_outstanding() -> None:
    """The host may hint its queue between a lookup and the load of what it
    found: hints change no block, so a held reset stays held."""
    _, hosted = make()
    chain = stored(hosted, 1, 2)
    ticket = hosted.hint(chain)
    assert hosted.stats().window.requests == 1
    assert hosted.lookup(chain) == 2
    reset = hosted.reset()
    hosted.unhint(ticket)
    later = hosted.hint(hashes(3))
    assert not reset.done()
    hosted.prepare_load(chain)
    assert reset.result(timeout=1).kind == "reset"
    hosted.complete_load(chain)
    with pytest.raises(UnknownTicketError):
        hosted.unhint(ticket)
    hosted.unhint(later)
    assert hosted.stats().window.requests == 0


def test_pause_and_resume_are_not_for_a_hosted_manager() -> None:
    _, hosted = make()
    with pytest.raises(UnsupportedCommandError, match="host's scheduler drives it"):
        hosted.pause()
    with pytest.raises(UnsupportedCommandError):
        hosted.resume()


def test_closed_manager_refuses_commands_but_keeps_serving_the_host() -> None:
    _, hosted = make()
    hosted.close()
    assert hosted.state == "stopped"
    assert hosted.snapshot().state == "stopped"
    with pytest.raises(EngineStoppedError):
        hosted.switch_policy("arc").result(timeout=1)
    assert hosted.lookup(hashes(1)) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commands_from_another_thread_never_overlap_the_hosts_calls(seed: int) -> None:
    """The host drives the protocol in a seeded loop, pausing now and then (an
    idle scheduler), and loads what its lookups found, as vLLM's scheduler
    does; another thread hammers policy switches, resets and snapshots. No
    call overlaps another, no load fails, every command resolves, the books
    balance."""
    manager, hosted = make(capacity=32)
    stop = threading.Event()
    results: list[CommandResult] = []
    resets: list[CommandResult] = []
    failures: list[BaseException] = []

    def admin() -> None:
        rng = random.Random(seed + 100)
        policies = ("lru", "arc", "kvarc")
        while not stop.is_set():
            try:
                if rng.random() < 0.1:
                    resets.append(hosted.reset().result(timeout=5))
                    continue
                results.append(hosted.switch_policy(rng.choice(policies)).result(timeout=5))
                snap = hosted.snapshot()
                assert snap.manager.used + snap.manager.free == snap.manager.capacity
            except BaseException as exc:  # surfaced below
                failures.append(exc)
                return

    thread = threading.Thread(target=admin)
    thread.start()
    rng = random.Random(seed)
    pinned: list[list[BlockHash]] = []
    in_flight: list[list[BlockHash]] = []
    try:
        for step in range(3000):
            chain = hashes(*range(rng.randrange(60), rng.randrange(60, 80)))
            hosted.touch(chain)
            hit = hosted.lookup(chain)
            if hit and rng.random() < 0.5:
                hosted.prepare_load(chain[:hit])
                pinned.append(chain[:hit])
            out = hosted.prepare_store(chain[hit : hit + 4])
            if out is not None and out.block_hashes_to_store:
                in_flight.append(out.block_hashes_to_store)
            if in_flight and rng.random() < 0.7:
                hosted.complete_store(in_flight.pop(0), success=rng.random() < 0.9)
            if pinned and rng.random() < 0.7:
                hosted.complete_load(pinned.pop(0))
            if step % 7 == 0:
                hosted.take_events()
            if step % 500 == 0:
                time.sleep(0.02)  # the host goes idle: commands land meanwhile
    finally:
        stop.set()
        thread.join(10)
    assert failures == []
    assert manager.overlaps == 0
    assert len(results) > 10, "the admin thread got commands through"
    assert sum(int(r.detail["cpu_blocks_evicted"]) > 0 for r in resets) > 2
    # commands were applied by both threads: the host's and the submitter's
    assert len(manager.threads) == 2
    # each switch to another policy is the next version; one to the policy
    # in use keeps it (it changes nothing)
    expected, version, policy = [], 1, "lru"
    for r in results:
        version += r.policy != policy
        policy = r.policy
        expected.append(version)
    assert [r.policy_version for r in results] == expected
    assert any(r.detail["from"] == r.detail["to"] for r in results)
    for chain in in_flight:
        hosted.complete_store(chain)
    for chain in pinned:
        hosted.complete_load(chain)
    stats = hosted.stats()
    assert stats.used + stats.free == stats.capacity
    assert stats.pinned == 0 and stats.in_flight == 0


def test_a_command_callback_may_call_the_hosted_manager() -> None:
    """A future's done-callback runs on whichever thread applied the command,
    the host's included; it once ran under the lock, and a callback calling
    the manager (or an argument iterator that made another thread submit a
    command) hung the host's thread for good."""
    _, hosted = make(capacity=4)
    seen: list[str] = []

    def admin() -> None:
        hosted.switch_policy("arc").add_done_callback(lambda f: seen.append(hosted.stats().policy))

    def chain() -> Iterator[BlockHash]:
        thread = threading.Thread(target=admin)
        thread.start()
        thread.join()
        yield b"a"

    host = threading.Thread(target=lambda: hosted.touch(chain()), daemon=True)
    host.start()
    host.join(10)
    assert not host.is_alive(), "the host's thread hung"
    assert seen == ["arc"]
    # and a callback on an idle manager, run by the submitting thread
    hosted.switch_policy("lru").add_done_callback(lambda f: seen.append(hosted.stats().policy))
    assert seen == ["arc", "lru"]


class Applied(EngineObserver):
    """Records each command_applied: the result, whether its future was
    already resolved, and whether the hosted manager's lock was free."""

    def __init__(self, hosted: HostedManager, futures: list[Future[CommandResult]]) -> None:
        self.hosted, self.futures = hosted, futures
        self.seen: list[tuple[CommandResult, bool, bool]] = []

    def command_applied(self, result: CommandResult) -> None:
        lock_free = self.hosted._lock.acquire(blocking=False)
        if lock_free:
            self.hosted._lock.release()
        self.seen.append((result, all(f.done() for f in self.futures), lock_free))


def test_observers_hear_of_each_command_that_changed_something(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The hosted manager tells its observers what the runtime's engine
    tells them: each applied command that changed something (a log record
    of a policy switch inside vLLM comes from this), after its future is
    resolved, with the lock released; a failing observer is logged and
    dropped, and changes nothing for the host or the other observers."""
    manager = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=8), policy="lru")
    futures: list[Future[CommandResult]] = []

    class Failing(EngineObserver):
        def command_applied(self, result: CommandResult) -> None:
            raise RuntimeError("observer bug")

    hosted = HostedManager(manager)
    applied = Applied(hosted, futures)
    hosted.observers = (Failing(), applied)
    futures.append(hosted.switch_policy("arc"))
    assert futures[-1].result(timeout=1).policy == "arc"
    futures.append(hosted.switch_policy("arc"))  # the same policy: changes nothing
    assert futures[-1].result(timeout=1).changed_nothing
    futures.append(hosted.switch_policy("lru", expected_version=1))  # stale: fails
    with pytest.raises(VersionConflictError):
        futures[-1].result(timeout=1)
    futures.append(hosted.reset())
    assert futures[-1].result(timeout=1).kind == "reset"
    assert [(r.kind, r.policy, done, free) for r, done, free in applied.seen] == [
        ("switch_policy", "arc", True, True),
        ("reset", "arc", True, True),
    ]
    failed = [r for r in caplog.records if r.exc_info and str(r.exc_info[1]) == "observer bug"]
    assert len(failed) == 2
    assert HostedManager(manager).observers == ()
