"""A policy of one's own that breaks the seam's contract is caught by the
manager before it frees anything (an audit found a policy answering one
victim twice, or one more than asked, freeing a block id twice and
reporting better-than-Belady hits with no error); kvoffload's own policies
are trusted unchecked (their victims come from the table's ``evict``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Sequence
from enum import IntEnum

import pytest

from kvoffload import CPUBackend, PolicyContractError, PolicyOffloadingManager, policies
from kvoffload.abstract import BlockHash
from kvoffload.policies import EvictionPolicy, Victims, is_builtin
from kvoffload.policies.kvarc import KVARCPolicy

CAPACITY = 4


class _Lists(IntEnum):
    A = 0


class _Fifo(EvictionPolicy):
    """A well-behaved policy; the broken ones below change one answer."""

    name = "fifo"
    lists = _Lists

    def insert(self, block_hashes: Sequence[BlockHash], blocks: Sequence[int]) -> None:
        self.table.insert(block_hashes, blocks, _Lists.A)

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        return self.evict_from(_Lists.A, n, protected)


def _h(i: int) -> BlockHash:
    return BlockHash(b"h%d" % i)


def _broken(evict: Callable[[_Fifo, int, Container[BlockHash]], object]) -> type[_Fifo]:
    return type("Broken", (_Fifo,), {"name": "broken", "evict": evict})


def _repeated(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    victims = self.evict_from(_Lists.A, n, protected)
    assert victims is not None
    hashes, handles = victims
    return [*hashes[:-1], hashes[0]], handles


def _one_more(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    return self.evict_from(_Lists.A, n + 1, protected)


def _one_fewer(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    victims = self.evict_from(_Lists.A, n, protected)
    assert victims is not None
    return victims[0][:-1], victims[1][:-1]


def _silently_removing(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    victims = self.evict_from(_Lists.A, n + 1, protected)
    assert victims is not None
    return victims[0][:n], victims[1][:n]


def _protected_too(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    return self.evict_from(_Lists.A, n, ())  # evicts the blocks the call names


def _wrong_victim(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    victims = self.evict_from(_Lists.A, n, protected)
    assert victims is not None
    hashes, handles = victims
    return [*hashes[:-1], _h(3)], handles  # h3 stays resident, the real victim is lost


def _not_victims(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    return 42


def _made_up(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    return [_h(100 + i) for i in range(n)], list(range(n))  # none removed


def _none_after_removing(self: _Fifo, n: int, protected: Container[BlockHash]) -> object:
    self.evict_from(_Lists.A, n, protected)
    return None


@pytest.fixture(autouse=True)
def _registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))


def _manager(cls: type[EvictionPolicy]) -> PolicyOffloadingManager:
    # the test module is imported under its file name by pytest
    policies._REGISTRY[cls.name] = f"{__name__}:{cls.__qualname__}"
    globals()[cls.__qualname__] = cls
    manager = PolicyOffloadingManager(CPUBackend(16, CAPACITY), policy=cls.name)
    out = manager.prepare_store([_h(i) for i in range(CAPACITY)])
    assert out is not None
    manager.complete_store(out.block_hashes_to_store)
    return manager


@pytest.mark.parametrize(
    ("evict", "says"),
    [
        (_repeated, "a victim more than once"),
        (_one_more, r"3 hashes and 3 handles for the 2 victims asked"),
        (_one_fewer, r"1 hashes and 1 handles for the 2 victims asked"),
        (_silently_removing, "2 victims but 3 blocks removed from the table"),
        (_protected_too, r"victim b'h0', which the call names \(protected\)"),
        (_wrong_victim, r"victim b'h3', still resident"),
        (_not_victims, r"evict answered int, not \(hashes, handles\)"),
        (_made_up, r"2 victims but 0 blocks removed"),
        (_none_after_removing, "evict answered None but removed 2 blocks"),
    ],
)
def test_a_policy_breaking_the_evict_contract_is_named_before_anything_is_freed(
    evict: Callable[[_Fifo, int, Container[BlockHash]], object], says: str
) -> None:
    manager = _manager(_broken(evict))
    free = manager.backend.get_num_free_blocks()
    with pytest.raises(PolicyContractError) as info:
        manager.prepare_store([_h(0), _h(10), _h(11)])  # names h0; two victims needed
    message = str(info.value)
    assert re.match(rf"eviction policy 'broken' broke its contract: .*{says}", message), message
    assert message.endswith("(see docs/writing-a-policy.md); this manager is not to be used again")
    assert manager.backend.get_num_free_blocks() == free  # no block id freed (twice)


def test_a_policy_answering_none_with_blocks_to_clear_is_named() -> None:
    manager = _manager(_broken(lambda self, n, protected: None))
    # allowed elsewhere; at a clear every idle block must go (nothing changed)
    with pytest.raises(
        PolicyContractError,
        match=r"evict answered None at a clear, which evicts every idle block \(4, none "
        r"protected\) .*; nothing was changed, the manager works on",
    ):
        manager.clear()
    assert len(manager) == CAPACITY


@pytest.mark.parametrize("keep", [-1, None, 1.5, 4, True])
def test_an_admit_answer_out_of_range_is_named(keep: object) -> None:
    cls = type("Admits", (_Fifo,), {"name": "admits", "admit": lambda self, hs, n, p: keep})
    manager = _manager(cls)
    manager.hint([_h(i) for i in range(CAPACITY)])  # every resident block is awaited
    with pytest.raises(
        PolicyContractError,
        match=r"admit answered .*, not an int from 0 to 3 .*; nothing was changed",
    ):
        manager.prepare_store([_h(10), _h(11), _h(12)])


def test_a_policy_keeping_the_contract_is_not_refused() -> None:
    manager = _manager(_Fifo)
    for i in range(10, 30, 2):
        out = manager.prepare_store([_h(i), _h(i + 1)])
        assert out is not None
        manager.complete_store(out.block_hashes_to_store)
    assert len(manager.clear()) == CAPACITY


def test_only_kvoffloads_own_classes_go_unchecked() -> None:
    assert all(is_builtin(policies.policy_class(n)) for n in policies.available_policies())
    assert not is_builtin(_Fifo)
    assert not is_builtin(type("MyKVARC", (KVARCPolicy,), {"name": "mykvarc"}))
