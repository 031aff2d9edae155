"""The policy registry refuses what it could not serve, when it is told,
not at first use (an audit found names that could never be chosen and
targets that failed later with AttributeError or TypeError)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvoffload import CPUBackend, PolicyError, PolicyOffloadingManager, policies
from kvoffload.policies import available_policies, policy_class, register_policy


@pytest.fixture(autouse=True)
def _registry() -> Iterator[None]:
    saved = dict(policies._REGISTRY)
    yield
    policies._REGISTRY.clear()
    policies._REGISTRY.update(saved)


@pytest.mark.parametrize("name", ["MyLRU", "", " lru2", None, 3, "1st", "x" * 65, "a b"])
def test_a_name_that_could_not_be_chosen_is_refused(name: object) -> None:
    with pytest.raises(PolicyError, match="must be lower case letters"):
        register_policy(name, "kvoffload.policies.lru:LRUPolicy")  # type: ignore[arg-type]
    assert available_policies() == ("arc", "hkvarc", "kvarc", "lru")  # and still sorts


@pytest.mark.parametrize("target", ["mod", "no colon.here", ":X", "a:", "a.:B", None])
def test_a_target_not_module_colon_class_is_refused(target: object) -> None:
    with pytest.raises(PolicyError, match=r"must be 'package\.module:Class'"):
        register_policy("mine", target)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("no.such.module:X", "does not import: ModuleNotFoundError"),
        ("kvoffload.policies.lru:NoSuchClass", "does not import: AttributeError"),
        ("collections:OrderedDict", "is not an EvictionPolicy subclass"),
    ],
)
def test_a_target_that_does_not_serve_fails_as_a_policy_error(target: str, says: str) -> None:
    register_policy("mine", target)
    with pytest.raises(PolicyError, match=says):
        policy_class("mine")
    with pytest.raises(PolicyError, match=says):
        PolicyOffloadingManager(CPUBackend(16, 4), policy="mine")


def test_a_registered_name_is_chosen_in_any_case() -> None:
    register_policy("my-lru", "kvoffload.policies.lru:LRUPolicy")
    assert PolicyOffloadingManager(CPUBackend(16, 4), policy="MY-LRU").policy_name == "lru"
    with pytest.raises(PolicyError, match="already registered"):
        register_policy("my-lru", "kvoffload.policies.lru:LRUPolicy")
