"""The eviction policy: read it, switch it live, or dry-run a switch."""

from __future__ import annotations

from fastapi import APIRouter

from app.commands import apply, unknown_policy, version_conflict
from app.deps import AdminAccess, ReadAccess, ServiceDep
from app.errors import error_responses
from app.models import (
    PolicySwitchRequest,
    PolicySwitchResult,
    PolicyValidateRequest,
    PolicyValidation,
    PolicyView,
)
from kvoffload.errors import PolicyError

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["policy"])


@router.get(
    "/policy",
    response_model=PolicyView,
    summary="Current policy, its version and the policies available",
    responses=error_responses(401),
)
async def get_policy(_: ReadAccess, service: ServiceDep) -> PolicyView:
    engine = service.engine
    snap = engine.snapshot()
    return PolicyView(
        policy=snap.manager.policy,
        version=snap.policy_version,
        available=list(engine.available_policies),
    )


@router.put(
    "/policy",
    response_model=PolicySwitchResult,
    summary="Switch the eviction policy live",
    description="Resident blocks migrate to the new policy without a flush; in-flight "
    "jobs are untouched. With `expected_version` the switch applies only if nobody "
    "switched since you read that version (409 otherwise). The answer names the "
    "engine step after which the switch took effect.",
    responses=error_responses(400, 401, 403, 409, 422, 503, 504),
)
async def put_policy(
    body: PolicySwitchRequest, _: AdminAccess, service: ServiceDep
) -> PolicySwitchResult:
    engine = service.engine
    requested: dict[str, str | int] = {"kvoffload.admin.requested_policy": body.policy}
    if body.expected_version is not None:
        requested["kvoffload.admin.expected_version"] = body.expected_version
    result, _snap = await apply(
        service,
        "switch_policy",
        lambda: engine.switch_policy(body.policy, expected_version=body.expected_version),
        requested,
    )
    return PolicySwitchResult(
        policy=result.policy,
        previous_policy=result.detail.get("from"),
        version=result.policy_version,
        applied_at_step=result.applied_at_step,
    )


@router.post(
    "/policy:validate",
    response_model=PolicyValidation,
    summary="Dry run of PUT /v1/policy: same checks, nothing applied",
    description="Changes nothing, so the read scope suffices.",
    responses=error_responses(400, 401, 409, 422),
)
async def validate_policy(
    body: PolicyValidateRequest, _: ReadAccess, service: ServiceDep
) -> PolicyValidation:
    engine = service.engine
    try:
        engine.validate_policy(body.policy)
    except PolicyError as exc:
        raise unknown_policy(exc, engine.available_policies) from None
    snap = engine.snapshot()
    if body.expected_version is not None and body.expected_version != snap.policy_version:
        raise version_conflict(body.expected_version, snap.policy_version)
    return PolicyValidation(
        valid=True,
        policy=body.policy.lower(),
        current_policy=snap.manager.policy,
        current_version=snap.policy_version,
    )
