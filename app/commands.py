"""Sending a command to the engine and waiting for it without blocking the
event loop; engine errors become :class:`~app.errors.ApiError`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from app.errors import ApiError
from kvoffload.errors import PolicyError
from kvoffload.runtime import Engine
from kvoffload.runtime.commands import CommandResult, EngineStoppedError, VersionConflictError
from kvoffload.runtime.snapshot import EngineSnapshot

__all__ = ["apply", "unknown_policy", "version_conflict"]

#: how long to wait for the engine to publish the snapshot after a command
#: resolved (it publishes right after, so this is a bound, not a delay)
_PUBLISH_GRACE = 1.0


def unknown_policy(exc: PolicyError, valid: tuple[str, ...]) -> ApiError:
    return ApiError(422, "unknown_policy", str(exc), valid_policies=list(valid))


def version_conflict(expected: int, current: int) -> ApiError:
    return ApiError(
        409,
        "version_conflict",
        f"the policy version is {current}, not the expected {expected}; "
        "GET /v1/policy and retry with the current version",
        expected_version=expected,
        current_version=current,
    )


def engine_stopped(exc: Exception) -> ApiError:
    return ApiError(
        503,
        "engine_stopped",
        f"the engine is not running, so it cannot apply commands ({exc})",
    )


def _reflects(snap: EngineSnapshot, result: CommandResult) -> bool:
    """Whether ``snap`` was published after ``result`` was applied."""
    if snap.policy_version < result.policy_version or snap.step < result.applied_at_step:
        return False
    if result.kind == "pause":
        return snap.state != "running"
    if result.kind == "resume":
        return snap.state != "paused"
    return True


async def apply(
    engine: Engine,
    send: Callable[[], Future[CommandResult]],
    *,
    timeout: float,
) -> tuple[CommandResult, EngineSnapshot]:
    """Queue a command with ``send()``, wait at most ``timeout`` seconds for the
    engine thread to apply it, and return the result with the first snapshot
    that shows it (so a client's next read sees its own write)."""
    result = await _wait(send, timeout=timeout, valid_policies=engine.available_policies)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _PUBLISH_GRACE
    snap = engine.snapshot()
    while not _reflects(snap, result) and loop.time() < deadline:
        await asyncio.sleep(0.001)
        snap = engine.snapshot()
    return result, snap


async def _wait(
    send: Callable[[], Future[CommandResult]],
    *,
    timeout: float,
    valid_policies: tuple[str, ...],
) -> CommandResult:
    try:
        future = send()
    except PolicyError as exc:
        raise unknown_policy(exc, valid_policies) from None
    except EngineStoppedError as exc:
        raise engine_stopped(exc) from None
    try:
        # shield: a timeout must not cancel the engine's future (the engine
        # would then fail to set its result); the command simply stays queued.
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    except TimeoutError:
        raise ApiError(
            504,
            "engine_timeout",
            f"the engine did not apply the command within {timeout:g} s; it stays queued "
            "and may still apply: check GET /v1/policy and /readyz before retrying",
        ) from None
    except VersionConflictError as exc:
        raise version_conflict(exc.expected, exc.current) from None
    except PolicyError as exc:
        raise unknown_policy(exc, valid_policies) from None
    except EngineStoppedError as exc:
        raise engine_stopped(exc) from None
