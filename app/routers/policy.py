"""The eviction policy: read it, switch it live, or dry-run a switch."""

from __future__ import annotations

from fastapi import APIRouter

from app.auth import GuardedRoute
from app.commands import apply
from app.deps import AdminAccess, ReadAccess, ServiceDep
from app.errors import error_responses
from app.models import (
    PolicySwitchRequest,
    PolicySwitchResult,
    PolicyValidateRequest,
    PolicyValidation,
    PolicyView,
)
from kvoffload.policies import available_policies
from kvoffload.runtime.commands import check_version

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["policy"], route_class=GuardedRoute)


@router.get(
    "/policy",
    response_model=PolicyView,
    summary="Current policy, its version and the policies available",
    responses=error_responses(401),
)
async def get_policy(_: ReadAccess, service: ServiceDep) -> PolicyView:
    snap = service.target.snapshot()
    return PolicyView(
        policy=snap.manager.policy,
        version=snap.policy_version,
        available=list(available_policies()),
    )


@router.put(
    "/policy",
    response_model=PolicySwitchResult,
    summary="Switch the eviction policy live",
    description="Resident blocks migrate to the new policy without a flush; in-flight "
    "jobs are untouched. With `expected_version` the switch applies only if nobody "
    "switched since you read that version (409 otherwise). The answer names the "
    "engine step after which the switch took effect.",
    responses=error_responses(400, 401, 403, 408, 409, 413, 415, 422, 503, 504),
)
async def put_policy(
    body: PolicySwitchRequest, _: AdminAccess, service: ServiceDep
) -> PolicySwitchResult:
    target = service.target
    requested: dict[str, str | int] = {"kvoffload.admin.requested_policy": body.policy}
    if body.expected_version is not None:
        requested["kvoffload.admin.expected_version"] = body.expected_version
    result, _snap = await apply(
        service,
        "switch_policy",
        lambda: target.switch_policy(body.policy, expected_version=body.expected_version),
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
    responses=error_responses(400, 401, 408, 409, 413, 415, 422),
)
async def validate_policy(
    body: PolicyValidateRequest, _: ReadAccess, service: ServiceDep
) -> PolicyValidation:
    # The body's policy name is checked by its type (PolicyName); its class
    # must import (what a PUT checks before the switch is queued).
    target = service.target
    target.validate_policy(body.policy)
    snap = target.snapshot()
    check_version(body.expected_version, snap.policy_version)
    return PolicyValidation(
        valid=True,
        policy=body.policy,
        current_policy=snap.manager.policy,
        current_version=snap.policy_version,
    )
