"""Sending a command to the engine and waiting for it without blocking the
event loop; engine errors become :class:`~app.errors.ApiError`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from opentelemetry.trace import Status, StatusCode

from app.errors import ApiError
from app.state import ServiceState
from kvoffload.errors import PolicyError
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
    service: ServiceState,
    action: str,
    send: Callable[[], Future[CommandResult]],
    attributes: dict[str, str | int] | None = None,
) -> tuple[CommandResult, EngineSnapshot]:
    """Queue a command with ``send()``, wait at most the configured command
    timeout for the engine thread to apply it, and return the result with the
    snapshot read right after (the engine publishes before it resolves the
    future, so the snapshot shows the command: a client's next read sees its
    own write).

    The whole exchange is one span ``kvoffload.admin.<action>`` carrying the
    request's ``attributes``, the outcome (``applied`` or the error code) and,
    when applied, the policy, its version and the step it took effect at.
    """
    engine = service.engine
    timeout = service.settings.command_timeout
    with service.tracer.start_as_current_span(
        f"kvoffload.admin.{action}",
        attributes={"kvoffload.admin.action": action, **(attributes or {})},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            result = await _wait(send, timeout=timeout, valid_policies=engine.available_policies)
        except ApiError as exc:
            span.set_attribute("kvoffload.admin.outcome", exc.code)
            span.set_status(Status(StatusCode.ERROR, exc.code))
            raise
        span.set_attributes(
            {
                "kvoffload.admin.outcome": "applied",
                "kvoffload.policy": result.policy,
                "kvoffload.policy.version": result.policy_version,
                "kvoffload.step": result.applied_at_step,
            }
        )
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
