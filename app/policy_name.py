"""The eviction policy name, validated and normalised in one place.

:data:`PolicyName` is what the settings (``KVOFFLOAD_POLICY``, ``--policy``)
and the request bodies (``PUT /v1/policy``, ``POST /v1/policy:validate``)
declare: surrounding whitespace and case are dropped, and a name that no
registered policy has fails with the error type ``unknown_policy``, which the
API answers as 422 ``unknown_policy`` with the valid names.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticCustomError

from kvoffload.policies import available_policies

__all__ = ["UNKNOWN_POLICY", "PolicyName"]

#: the pydantic error type of a name no registered policy has
UNKNOWN_POLICY = "unknown_policy"


def _normalise(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


def _registered(value: str) -> str:
    valid = available_policies()
    if value not in valid:
        raise PydanticCustomError(
            UNKNOWN_POLICY,
            "unknown eviction policy {policy!r}; valid policies: {valid}",
            {"policy": value, "valid": ", ".join(valid)},
        )
    return value


def _schema(schema: dict[str, Any]) -> None:
    # Read when a schema is built, so that policies registered by then are listed.
    schema["enum"] = list(available_policies())


PolicyName = Annotated[
    str,
    BeforeValidator(_normalise),
    Field(max_length=64, examples=["arc"], json_schema_extra=_schema),
    AfterValidator(_registered),
]
