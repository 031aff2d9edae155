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


async def apply(
    engine: Engine,
    send: Callable[[], Future[CommandResult]],
    *,
    timeout: float,
) -> tuple[CommandResult, EngineSnapshot]:
    """Queue a command with ``send()``, wait at most ``timeout`` seconds for the
    engine thread to apply it, and return the result with the snapshot read
    right after (the engine publishes before it resolves the future, so the
    snapshot shows the command: a client's next read sees its own write)."""
    result = await _wait(send, timeout=timeout, valid_policies=engine.available_policies)
    return result, engine.snapshot()


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
