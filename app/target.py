"""What the admin service serves: the small protocol both the runtime's
:class:`~kvoffload.runtime.Engine` and a
:class:`~kvoffload.runtime.HostedManager` satisfy.

Reads come from :meth:`AdminTarget.snapshot` (immutable, safe from any thread)
and :attr:`AdminTarget.event_log` (thread-safe reads and drains). Commands
return a future that the target resolves once it has applied them on the
thread that owns the manager; a command the target does not support raises
:class:`~kvoffload.runtime.commands.UnsupportedCommandError`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from kvoffload.event_log import EventLog
from kvoffload.runtime.commands import CommandResult
from kvoffload.runtime.snapshot import EngineSnapshot, EngineState

__all__ = ["AdminTarget"]


class AdminTarget(Protocol):
    @property
    def config(self) -> object:
        """A dataclass whose scalar fields are exported as ``kvoffload_config_info``."""

    @property
    def event_log(self) -> EventLog | None:
        """``None`` when the manager records no events."""

    @property
    def state(self) -> EngineState: ...

    def snapshot(self) -> EngineSnapshot: ...

    def validate_policy(self, policy: str) -> None:
        """Raise :class:`~kvoffload.errors.PolicyError` for a name that is not
        registered, :class:`~kvoffload.errors.PolicyFailedError` for one whose
        class does not import."""

    def switch_policy(
        self, policy: str, expected_version: int | None = None
    ) -> Future[CommandResult]: ...

    def reset(self) -> Future[CommandResult]: ...

    def pause(self) -> Future[CommandResult]: ...

    def resume(self) -> Future[CommandResult]: ...
