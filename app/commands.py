"""Sending a command to the target and waiting for it without blocking the
event loop. The library's errors pass through to the handlers of
:mod:`app.errors`; only the wait's own timeout is answered here (504)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from opentelemetry.trace import Status, StatusCode

from app.errors import ApiError, library_error
from app.state import ServiceState
from kvoffload.runtime.commands import CommandResult
from kvoffload.runtime.snapshot import EngineSnapshot

__all__ = ["apply"]


async def apply(
    service: ServiceState,
    action: str,
    send: Callable[[], Future[CommandResult]],
    attributes: dict[str, str | int] | None = None,
) -> tuple[CommandResult, EngineSnapshot]:
    """Queue a command with ``send()``, wait at most the configured command
    timeout for the target to apply it, and return the result with the
    snapshot read right after (the target publishes before it resolves the
    future, so the snapshot shows the command: a client's next read sees its
    own write).

    ``send()`` runs in a worker thread: a hosted manager may apply the command
    at once, on the calling thread, which must not be the event loop's.

    The whole exchange is one span ``kvoffload.admin.<action>`` carrying the
    request's ``attributes``, the outcome (``applied``, ``unchanged`` for a
    command that changed nothing, or the error code) and, when answered, the
    policy, its version and the step it took effect at.
    """
    timeout = service.settings.command_timeout
    with service.tracer.start_as_current_span(
        f"kvoffload.admin.{action}",
        attributes={"kvoffload.admin.action": action, **(attributes or {})},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            future = await asyncio.to_thread(send)
            # shield: a timeout must not cancel the target's future (it would
            # then fail to set its result); the command simply stays queued.
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except TimeoutError:
            span.set_attribute("kvoffload.admin.outcome", "engine_timeout")
            span.set_status(Status(StatusCode.ERROR, "engine_timeout"))
            raise ApiError(
                504,
                "engine_timeout",
                f"the engine did not apply the command within {timeout:g} s; it stays queued "
                "and may still apply: check GET /v1/policy and /readyz before retrying",
            ) from None
        except Exception as exc:
            error = library_error(exc)
            code = error.code if error is not None else "internal_error"
            span.set_attribute("kvoffload.admin.outcome", code)
            span.set_status(Status(StatusCode.ERROR, code))
            raise
        span.set_attributes(
            {
                # a switch to the policy in use, a pause of an engine not
                # running, a resume of a running one: answered, but no command
                "kvoffload.admin.outcome": "unchanged" if result.changed_nothing else "applied",
                "kvoffload.policy": result.policy,
                "kvoffload.policy.version": result.policy_version,
                "kvoffload.step": result.applied_at_step,
            }
        )
        return result, service.target.snapshot()
