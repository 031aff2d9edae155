"""Eviction policies and their registry.

Adding a policy is one module with an :class:`EvictionPolicy` subclass plus
one :func:`register_policy` call (or an entry in :data:`_REGISTRY`); modules
are imported only when the policy is first used. A policy orders the blocks
of a manager's :class:`~kvoffload.table.BlockTable`; it is made by the
manager. ``docs/writing-a-policy.md`` walks through one.
"""

from __future__ import annotations

import importlib

from kvoffload.errors import PolicyError
from kvoffload.policies.base import EvictionPolicy, Victims
from kvoffload.table import STAY, BlockTable, TouchRules

__all__ = [
    "STAY",
    "EvictionPolicy",
    "TouchRules",
    "Victims",
    "available_policies",
    "create_policy",
    "policy_class",
    "register_policy",
]

#: policy name -> "module:ClassName"
_REGISTRY: dict[str, str] = {
    "lru": "kvoffload.policies.lru:LRUPolicy",
    "arc": "kvoffload.policies.arc:ARCPolicy",
    "kvarc": "kvoffload.policies.kvarc:KVARCPolicy",
    "hkvarc": "kvoffload.policies.hkvarc:HKVARCPolicy",
}


def available_policies() -> tuple[str, ...]:
    """Names of the registered policies, sorted."""
    return tuple(sorted(_REGISTRY))


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class registered under ``name``; :class:`PolicyError` if unknown."""
    key = name.lower() if isinstance(name, str) else name
    target = _REGISTRY.get(key)
    if target is None:
        raise PolicyError(
            f"unknown eviction policy {name!r}; valid policies: {', '.join(available_policies())}"
        )
    module_name, _, attr = target.partition(":")
    cls: type[EvictionPolicy] = getattr(importlib.import_module(module_name), attr)
    return cls


def create_policy(name: str, capacity: int, table: BlockTable) -> EvictionPolicy:
    """A new policy ``name`` for a cache of ``capacity`` blocks kept in
    ``table`` (to be seeded with the blocks already there)."""
    return policy_class(name)(capacity, table)


def register_policy(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (for policies outside kvoffload)."""
    if name in _REGISTRY:
        raise PolicyError(f"eviction policy {name!r} is already registered")
    _REGISTRY[name] = target
