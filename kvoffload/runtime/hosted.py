"""A manager that someone else's scheduler drives, with admin commands applied
between its calls.

:class:`HostedManager` wraps a :class:`~kvoffload.manager.PolicyOffloadingManager`
whose protocol calls come from a host's thread (vLLM's scheduler, for one):
every verb delegates to the wrapped manager, and the admin commands (policy
switch, reset) queued from other threads reach the manager only between two
of those calls. Readers get immutable snapshots.

Threading contract:

- Each delegated call runs under one :class:`threading.Lock`, uncontended on
  the host's thread unless a command or a snapshot is being made. The wrapped
  manager is never called from two threads at once, and never re-entered.
- A command submitted while a host call runs is queued; it is applied by
  whichever thread next holds the lock: the host thread as its call returns,
  or the submitting thread when no call is running (the host's scheduler may
  be idle for minutes, and an operator's ``PUT /v1/policy`` must not wait for
  traffic). Every holder of the lock looks at the queue after releasing it,
  so a queued command never waits for a later call.
- A reset is held back while a lookup's answer is outstanding: after a
  ``lookup`` that found blocks, until the host's next call has returned. A
  host acts on that answer in its next call (vLLM's scheduler calls
  ``prepare_load`` for those blocks right after), and a reset in between
  would evict what it counted. Policy switches keep every block and are
  not held (one queued behind a held reset waits for it: commands keep
  their order).
- The snapshot is published under the lock after every command (so the next
  read shows it) and at the end of a host call when the last one is older
  than ``snapshot_max_age``; :meth:`snapshot` refreshes it itself, without
  waiting, when the host is idle.
- Observers hear of each command that changed something
  (``command_applied``, as the runtime's engine calls it) after its future
  is resolved, on the thread that applied it, with the lock released.

Do not call the wrapped manager directly once it is wrapped: that would
bypass the lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from kvoffload._checks import is_finite_number
from kvoffload.abstract import (
    BlockHash,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvoffload.backend import BlockStatus
from kvoffload.errors import ConfigError
from kvoffload.event_log import EventLog
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.policies import policy_class
from kvoffload.runtime.commands import (
    Command,
    CommandKind,
    CommandResult,
    EngineStoppedError,
    UnsupportedCommandError,
    apply_switch,
)
from kvoffload.runtime.observer import EngineObserver, notify
from kvoffload.runtime.snapshot import EngineSnapshot, EngineState, RuntimeStats
from kvoffload.stats import ManagerStats

__all__ = ["HostedConfig", "HostedManager"]

T = TypeVar("T")

#: a hosted manager has no serving loop of its own: its runtime counters stay 0
_NO_RUNTIME = RuntimeStats()


@dataclass(frozen=True, slots=True)
class HostedConfig:
    """What the admin service exports as ``kvoffload_config_info`` for a hosted manager."""

    num_cpu_blocks: int
    offloaded_block_size: int
    medium: str
    event_log_capacity: int | None


class HostedManager(OffloadingManager):
    """Wraps ``manager`` for a host's scheduler thread (see the module doc).

    Args:
        manager: the manager the host drives; call it only through this wrapper.
        description: shown as the ``workload`` of the snapshot.
        snapshot_max_age: seconds a published snapshot may age while the host
            keeps calling: a finite number >= 0 (0 publishes after every call).
        observers: told of each applied command (``command_applied``; the
            other hooks of :class:`~kvoffload.runtime.EngineObserver` need
            the runtime's engine steps): a
            :class:`~kvoffload.instrumentation.TracingObserver` makes a log
            record of each policy switch and reset.
    """

    def __init__(
        self,
        manager: PolicyOffloadingManager,
        *,
        description: str = "hosted: driven by the host's scheduler",
        snapshot_max_age: float = 0.05,
        observers: Sequence[EngineObserver] = (),
    ) -> None:
        if not is_finite_number(snapshot_max_age) or snapshot_max_age < 0:
            raise ConfigError(
                f"snapshot_max_age must be a finite number of seconds >= 0, "
                f"got {snapshot_max_age!r}"
            )
        self.manager = manager
        self.description = description
        self.snapshot_max_age = snapshot_max_age
        self.observers = tuple(observers)
        log = manager.event_log
        self.config = HostedConfig(
            num_cpu_blocks=manager.capacity,
            offloaded_block_size=manager.backend.block_size,
            medium=manager.backend.medium,
            event_log_capacity=log.capacity if log is not None else None,
        )
        self._lock = threading.Lock()
        self._queue: deque[tuple[Command, Future[CommandResult]]] = deque()
        #: futures of applied commands, resolved once the lock is released: a
        #: done-callback may call this manager (under the lock it would
        #: deadlock the host's thread)
        self._done: deque[tuple[Future[CommandResult], CommandResult | Exception]] = deque()
        self._pending = False
        # the last host call was a lookup that found blocks (see the module doc)
        self._lookup_outstanding = False
        self._calls = 0
        self._version = 1
        self._last_commands: Mapping[CommandKind, CommandResult] = MappingProxyType({})
        self._state: EngineState = "running"
        self._snapshot = self._take_snapshot()
        self._published = time.monotonic()

    # -- the protocol, delegated ----------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        return self._call(self._lookup, block_hashes)

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        return self._call(self.manager.prepare_load, block_hashes)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        self._call(self.manager.touch, block_hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        self._call(self.manager.complete_load, block_hashes)

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        return self._call(self.manager.prepare_store, block_hashes)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        self._call(self.manager.complete_store, block_hashes, success)

    def take_events(self) -> list[OffloadingEvent]:
        return self._call(self.manager.take_events)

    # Hints do not act on a lookup's answer (the host's next protocol call
    # does), so like queries they leave it outstanding: a reset stays held.
    def hint(self, block_hashes: Iterable[BlockHash]) -> int:
        """:meth:`PolicyOffloadingManager.hint` of the wrapped manager."""
        return self._call(self.manager.hint, block_hashes, query=True)

    def unhint(self, ticket: int) -> None:
        """:meth:`PolicyOffloadingManager.unhint` of the wrapped manager."""
        self._call(self.manager.unhint, ticket, query=True)

    def stats(self) -> ManagerStats:
        return self._call(self.manager.stats, query=True)

    def get_block(self, block_hash: BlockHash) -> BlockStatus | None:
        return self._call(self.manager.get_block, block_hash, query=True)

    def __len__(self) -> int:
        return self._call(self.manager.__len__, query=True)

    def __contains__(self, block_hash: object) -> bool:
        return self._call(self.manager.__contains__, block_hash, query=True)

    @property
    def capacity(self) -> int:
        return self.manager.capacity

    @property
    def policy_name(self) -> str:
        return self.manager.policy_name

    # -- what the admin service reads -----------------------------------------

    @property
    def event_log(self) -> EventLog | None:
        """The wrapped manager's log (its reads and drains are thread-safe)."""
        return self.manager.event_log

    @property
    def state(self) -> EngineState:
        """``running`` until :meth:`close`, then ``stopped``."""
        return self._state

    def snapshot(self) -> EngineSnapshot:
        """The latest published snapshot (immutable; safe from any thread).
        ``step`` is what :meth:`_step` counts (the host's calls so far, unless
        the host has steps of its own); runtime counters are 0."""
        if time.monotonic() - self._published >= self.snapshot_max_age and self._lock.acquire(
            blocking=False
        ):
            try:
                self._publish()
            finally:
                self._lock.release()
            self._apply_if_idle()
        return self._snapshot

    # -- commands ------------------------------------------------------------

    def validate_policy(self, policy: str) -> None:
        """Raise :class:`~kvoffload.errors.PolicyError` if ``policy`` is unknown
        (:class:`~kvoffload.errors.PolicyFailedError` if its class does not
        import)."""
        policy_class(policy)

    def switch_policy(
        self, policy: str, expected_version: int | None = None
    ) -> Future[CommandResult]:
        """Queue a live policy switch (see
        :meth:`~kvoffload.manager.PolicyOffloadingManager.switch_policy`).
        An unknown policy raises :class:`~kvoffload.errors.PolicyError` at
        once; a stale ``expected_version`` fails the future with
        :class:`~kvoffload.runtime.commands.VersionConflictError`."""
        self.validate_policy(policy)
        return self._submit(
            Command("switch_policy", policy=policy.lower(), expected_version=expected_version)
        )

    def reset(self) -> Future[CommandResult]:
        """Queue a reset: every resident block not in use is evicted, ghosts
        forgotten; held back while a lookup's answer is outstanding."""
        return self._submit(Command("reset"))

    def pause(self) -> Future[CommandResult]:
        raise UnsupportedCommandError(
            "pause is not supported for a hosted manager: the host's scheduler drives it"
        )

    def resume(self) -> Future[CommandResult]:
        raise UnsupportedCommandError(
            "resume is not supported for a hosted manager: the host's scheduler drives it"
        )

    def close(self) -> None:
        """Refuse further commands (they fail with
        :class:`~kvoffload.runtime.commands.EngineStoppedError`, queued ones
        too); the host may go on calling the manager."""
        with self._lock:
            self._state = "stopped"
            self._fail_queued()
            self._publish()
        self._settle()

    # -- inside ------------------------------------------------------------

    def _call(self, method: Callable[..., T], *args: object, query: bool = False) -> T:
        """``method(*args)`` under the lock; a ``query`` (stats, membership)
        is not a protocol call, so it leaves a lookup's answer outstanding.
        An iterator of hashes (the first argument, where there is one) is
        read first, outside the lock: one that calls this manager (from any
        thread) must not find the lock held. (Lists, what callers pass, cost
        one type check: this runs on every call the host's scheduler makes.)"""
        if args and type(args[0]) is not list and isinstance(args[0], Iterator):
            args = (list(args[0]), *args[1:])
        lock = self._lock
        lock.acquire()
        try:
            if self._pending:
                self._apply_queued()
            if not query:
                self._lookup_outstanding = False
            return method(*args)
        finally:
            self._calls += 1
            if self._queue and not self._lookup_outstanding:
                self._pending = True  # a reset held back until this call returned
            if time.monotonic() - self._published >= self.snapshot_max_age:
                self._publish()
            lock.release()
            self._settle()
            if self._pending:
                self._apply_if_idle()

    def _lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hits = self.manager.lookup(block_hashes)
        self._lookup_outstanding = hits > 0
        return hits

    def _submit(self, command: Command) -> Future[CommandResult]:
        fut: Future[CommandResult] = Future()
        if self._state == "stopped":
            fut.set_exception(EngineStoppedError("the hosted manager is closed"))
            return fut
        self._queue.append((command, fut))
        self._pending = True
        self._apply_if_idle()
        return fut

    def _apply_if_idle(self) -> None:
        # Whoever fails to take the lock here leaves the queue to its holder,
        # which comes back here after releasing it.
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._apply_queued()
            finally:
                self._lock.release()
            self._settle()

    def _settle(self) -> None:
        """Resolve the futures of applied commands (lock not held)."""
        while self._done:
            fut, outcome = self._done.popleft()
            if isinstance(outcome, Exception):
                fut.set_exception(outcome)
                continue
            fut.set_result(outcome)
            if not outcome.changed_nothing:
                for obs in self.observers:
                    notify(obs.command_applied, outcome)

    def _apply_queued(self) -> None:
        """Apply every queued command (lock held)."""
        # Cleared first: a command queued from here on sets it again.
        self._pending = False
        if self._state == "stopped":
            self._fail_queued()
            return
        while self._queue:
            command, fut = self._queue[0]
            if command.kind == "reset" and self._lookup_outstanding:
                return  # held: the host's next call re-arms it (see _call)
            self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = self._apply(command)
            except Exception as e:  # delivered to the submitter
                self._done.append((fut, e))
                continue
            if not result.changed_nothing:
                self._last_commands = MappingProxyType({**self._last_commands, result.kind: result})
            # publish first: a submitter woken by the future reads the snapshot
            self._publish()
            self._done.append((fut, result))

    def _step(self) -> int:
        """The step a snapshot shows and a command is applied after: here
        the host's calls so far; a host with steps of its own counts those
        (vLLM's scheduler steps, :class:`~kvoffload.vllm.admin.VLLMHostedManager`)."""
        return self._calls

    def _apply(self, command: Command) -> CommandResult:
        m = self.manager
        detail: dict[str, str] = {}
        if command.kind == "switch_policy":
            detail, self._version = apply_switch(m, command, self._version)
        else:
            assert command.kind == "reset", command
            detail = {"cpu_blocks_evicted": str(len(m.clear()))}
        return CommandResult(
            kind=command.kind,
            applied_at_step=self._step(),
            policy=m.policy_name,
            policy_version=self._version,
            detail=detail,
            timestamp=time.time(),
        )

    def _fail_queued(self) -> None:
        while self._queue:
            _, fut = self._queue.popleft()
            if fut.set_running_or_notify_cancel():
                self._done.append((fut, EngineStoppedError("the hosted manager is closed")))

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            state=self._state,
            step=self._step(),
            policy_version=self._version,
            workload=self.description,
            manager=self.manager.stats(),
            runtime=_NO_RUNTIME,
            timestamp=time.time(),
            commands=self._last_commands,
        )

    def _publish(self) -> None:
        self._snapshot = self._take_snapshot()
        self._published = time.monotonic()
