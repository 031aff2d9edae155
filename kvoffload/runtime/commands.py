"""Commands queued to the engine (or a hosted manager) and applied between
steps (or between the host's manager calls)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from kvoffload._checks import is_int
from kvoffload.errors import ConfigError, KVOffloadError

if TYPE_CHECKING:
    from kvoffload.manager import PolicyOffloadingManager

__all__ = [
    "Command",
    "CommandKind",
    "CommandResult",
    "EngineStoppedError",
    "UnsupportedCommandError",
    "VersionConflictError",
    "apply_switch",
    "check_version",
]

CommandKind = Literal["switch_policy", "pause", "resume", "reset"]


class VersionConflictError(KVOffloadError):
    """A policy switch named an ``expected_version`` that is no longer current."""

    def __init__(self, expected: int, current: int) -> None:
        super().__init__(
            f"policy version is {current}, not the expected {expected}; "
            "re-read the policy and retry with the current version"
        )
        self.expected = expected
        self.current = current


class EngineStoppedError(KVOffloadError):
    """A command was sent to an engine that has stopped."""


class UnsupportedCommandError(KVOffloadError):
    """The command does not apply to this target (e.g. pausing a manager whose
    calls a host's scheduler makes)."""


@dataclass(frozen=True, slots=True)
class Command:
    kind: CommandKind
    policy: str | None = None
    expected_version: int | None = None

    def __post_init__(self) -> None:
        # at once, where the switch is asked for (not in its future)
        _check_expected(self.expected_version)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What an applied command did and when."""

    kind: CommandKind
    #: the engine step after which the command took effect (steps done so far)
    applied_at_step: int
    policy: str
    policy_version: int
    detail: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: wall-clock time it took effect (seconds since the epoch; 0 if unknown)
    timestamp: float = 0.0

    @property
    def changed_nothing(self) -> bool:
        """A switch to the policy in use, a pause of an engine not running or
        a resume of one not paused: applied, and nothing changed (it is not
        the last command ``/metrics`` shows, and observers are not told)."""
        return self.kind in ("switch_policy", "pause", "resume") and self.detail.get(
            "from"
        ) == self.detail.get("to")


def _check_expected(expected: object) -> None:
    # bool is an int subclass: True is not version 1
    if expected is not None and not is_int(expected):
        raise ConfigError(f"expected_version must be an integer or None, got {expected!r}")


def check_version(expected: int | None, current: int) -> None:
    """Raise :class:`VersionConflictError` unless ``expected`` is ``None`` or
    ``current``; :class:`~kvoffload.errors.ConfigError` when it is not an
    integer (or ``None``)."""
    _check_expected(expected)
    if expected is not None and expected != current:
        raise VersionConflictError(expected, current)


def apply_switch(
    manager: PolicyOffloadingManager, command: Command, version: int
) -> tuple[dict[str, str], int]:
    """Apply the ``switch_policy`` ``command`` to ``manager`` whose policy is
    at ``version``; returns the result's detail and the version after it
    (one more, or the same when the command names the policy in use, which
    changes nothing: see
    :meth:`~kvoffload.manager.PolicyOffloadingManager.switch_policy`). A
    stale ``expected_version`` raises :class:`VersionConflictError` and an
    unknown policy :class:`~kvoffload.errors.PolicyError`, changing
    nothing."""
    assert command.kind == "switch_policy" and command.policy is not None, command
    check_version(command.expected_version, version)
    before = manager.policy
    old = manager.switch_policy(command.policy)
    switched = manager.policy is not before
    return {"from": old, "to": manager.policy_name}, version + 1 if switched else version
