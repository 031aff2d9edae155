"""Eviction policies and their registry.

Adding a policy is one module with an :class:`EvictionPolicy` subclass plus
one :func:`register_policy` call (or an entry in :data:`_REGISTRY`); modules
are imported only when the policy is first used. A policy orders the blocks
of a manager's :class:`~kvoffload.table.BlockTable`; it is made by the
manager. ``docs/writing-a-policy.md`` walks through one.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable

from kvoffload.errors import PolicyError, PolicyFailedError
from kvoffload.policies.base import EvictionPolicy, Victims
from kvoffload.table import STAY, BlockTable, TouchRules

__all__ = [
    "STAY",
    "EvictionPolicy",
    "TouchRules",
    "Victims",
    "available_policies",
    "create_policy",
    "import_policy_modules",
    "is_builtin",
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


#: the policies kvoffload ships, whose victims come from the table's own evict
_BUILTIN = frozenset(_REGISTRY.values())


def is_builtin(cls: type) -> bool:
    """Whether ``cls`` is one of the policies kvoffload ships (not a
    subclass of one): the manager trusts their answers unchecked."""
    return f"{cls.__module__}:{cls.__qualname__}" in _BUILTIN


def available_policies() -> tuple[str, ...]:
    """Names of the registered policies, sorted."""
    return tuple(sorted(_REGISTRY))


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class registered under ``name`` (any case); :class:`PolicyError`
    if unknown, :class:`PolicyFailedError` if its target does not import as
    an :class:`EvictionPolicy` subclass."""
    key = name.lower() if isinstance(name, str) else name
    target = _REGISTRY.get(key)
    if target is None:
        raise PolicyError(
            f"unknown eviction policy {name!r}; valid policies: {', '.join(available_policies())}"
        )
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PolicyFailedError(
            f"eviction policy {key!r} is registered as {target!r}, which does not import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise PolicyFailedError(
            f"eviction policy {key!r} is registered as {target!r}, which is not an "
            "EvictionPolicy subclass"
        )
    return cls


def create_policy(name: str, capacity: int, table: BlockTable) -> EvictionPolicy:
    """A new policy ``name`` for a cache of ``capacity`` blocks kept in
    ``table`` (to be seeded with the blocks already there)."""
    return policy_class(name)(capacity, table)


#: a policy's name: what users type (lower case; names are looked up in any case)
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
#: "package.module:Class"
_TARGET = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


def register_policy(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (for policies outside
    kvoffload). The module is imported when the policy is first used.
    :class:`PolicyError` for a name taken, or one that is not lower case
    letters, digits, ``-`` and ``_`` (at most 64, a letter first: looked up
    in any case, an upper-case name could never be chosen), or a target not
    of the form ``"package.module:Class"``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PolicyError(
            f"eviction policy name {name!r} must be lower case letters, digits, '-' and '_' "
            "(a letter first, at most 64)"
        )
    if not isinstance(target, str) or not _TARGET.fullmatch(target):
        raise PolicyError(f"eviction policy target {target!r} must be 'package.module:Class'")
    if name in _REGISTRY:
        raise PolicyError(f"eviction policy {name!r} is already registered")
    _REGISTRY[name] = target


def import_policy_modules(modules: Iterable[str]) -> None:
    """Import each module, in order: modules that register policies of their
    own (``kvoffload replay --import``, ``kvoffload serve --imports``, the
    vLLM spec's ``policy_modules``).
    :class:`PolicyError` naming the module and what went wrong (a module not
    found says where it would have to be), for any failure of its code."""
    for module in modules:
        try:
            importlib.import_module(module)
        except SystemExit as exc:  # the command exited silently with the module's status
            raise PolicyError(
                f"cannot import {module!r}: it called sys.exit({exc.code!r}) while being imported"
            ) from exc
        except Exception as exc:  # any failure of user code: one clear line
            hint = (
                " (it must be importable: installed, or on PYTHONPATH, e.g. PYTHONPATH=. for "
                "the current folder, which the kvoffload command does not search)"
                if isinstance(exc, ModuleNotFoundError) and exc.name == module.split(".")[0]
                else ""
            )
            raise PolicyError(
                f"cannot import {module!r}: {type(exc).__name__}: {exc}{hint}"
            ) from exc
