"""The eviction policy name, validated in one place.

:data:`PolicyName` is what the request bodies (``PUT /v1/policy``,
``POST /v1/policy:validate``) declare: exactly one of the registered names
(the OpenAPI schema's enum), or the error type ``unknown_policy``, which the
API answers as 422 ``unknown_policy`` with the valid names. Nothing is fixed
up: ``" ARC "`` is refused, with a hint at ``'arc'``. The settings
(``KVOFFLOAD_POLICY``, ``--policy``), typed by a person, take any case
(:data:`SettingsPolicyName`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticCustomError

from kvoffload.policies import available_policies

__all__ = ["UNKNOWN_POLICY", "PolicyName", "SettingsPolicyName"]

#: the pydantic error type of a name no registered policy has
UNKNOWN_POLICY = "unknown_policy"

#: longer names are refused before they are looked at
_MAX_LENGTH = 64


def _registered(value: str) -> str:
    valid = available_policies()
    if value not in valid:
        near = value.strip().lower()
        hint = f" (names are lower case, without spaces: {near!r}?)" if near in valid else ""
        # The name goes into the context as its repr: pydantic renders the
        # message in Rust, which refuses a lone surrogate ('\ud800') of the
        # raw string, and the repr escapes it.
        raise PydanticCustomError(
            UNKNOWN_POLICY,
            "unknown eviction policy {policy}; valid policies: {valid}{hint}",
            {"policy": repr(value), "valid": ", ".join(valid), "hint": hint},
        )
    return value


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


def _schema(schema: dict[str, Any]) -> None:
    # Read when a schema is built, so that policies registered by then are listed.
    schema["enum"] = list(available_policies())


PolicyName = Annotated[
    str,
    Field(max_length=_MAX_LENGTH, examples=["arc"], json_schema_extra=_schema),
    AfterValidator(_registered),
]

#: a setting's policy: surrounding spaces and case dropped (as ``--log-level``'s)
SettingsPolicyName = Annotated[
    str,
    Field(max_length=_MAX_LENGTH),
    BeforeValidator(_lower),
    AfterValidator(_registered),
]
