"""Block-hash builders, state capture and a counting backend shared by the core tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvoffload import BlockHash, PolicyOffloadingManager, PrepareStoreOutput
from kvoffload.backends.cpu import CPUBackend
from kvoffload.policies import EvictionPolicy


def bh(i: int) -> BlockHash:
    """A short, readable block hash for block number ``i``."""
    return BlockHash(b"h%d" % i)


def bhs(*ids: int) -> list[BlockHash]:
    return [bh(i) for i in ids]


def ids_of(spec: Any) -> list[int]:
    """The block ids of a load/store spec as plain ints."""
    return [int(i) for i in spec.block_ids]


def store(m: PolicyOffloadingManager, *ids: int) -> PrepareStoreOutput:
    """prepare_store + complete_store; fails the test if there is no room."""
    out = m.prepare_store(bhs(*ids))
    assert out is not None, f"no room to store {ids}"
    m.complete_store(out.block_hashes_to_store)
    return out


def ref_cnt(m: PolicyOffloadingManager, i: int | BlockHash) -> int | None:
    b = m.get_block(bh(i) if isinstance(i, int) else i)
    return None if b is None else b.ref_cnt


def policy_state(policy: EvictionPolicy) -> dict[str, Any]:
    """Everything a policy holds: each dict attribute as an ordered item list
    (so order changes show), other attributes as they are."""
    state: dict[str, Any] = {}
    for name, value in vars(policy).items():
        state[name] = list(value.items()) if isinstance(value, dict) else value
    return state


def manager_state(m: PolicyOffloadingManager) -> dict[str, Any]:
    """The observable state of a manager except its monotonic counters."""
    backend = m.backend
    assert isinstance(backend, CPUBackend)
    stats = m.stats()
    log = m.event_log
    return {
        "stats": (
            stats.policy,
            stats.capacity,
            stats.used,
            stats.free,
            stats.pinned,
            stats.in_flight,
            dict(stats.lists),
            dict(stats.params),
            stats.events,
        ),
        "blocks": [(h, handle, ref_cnt(m, h)) for h, handle in m.policy.ordered_items()],
        "policy": policy_state(m.policy),
        "backend": (list(backend.allocated_blocks_free_list), backend.num_allocated_blocks),
        "events": None if log is None else (log.last_seq, len(log)),
    }


class CountingRefs(dict[BlockHash, int]):
    """A manager's busy table whose ``get`` calls are counted: a policy has
    to look a block up there to know whether it may evict it, so the count
    is the number of entries an eviction scan examined."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, key: BlockHash, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)


def counting_manager(
    capacity: int, policy: str = "lru"
) -> tuple[PolicyOffloadingManager, CountingRefs]:
    """A manager whose policies read a :class:`CountingRefs` busy table."""
    m = PolicyOffloadingManager(CPUBackend(16, capacity), policy=policy)
    refs = CountingRefs()
    m._refs = refs  # swapped before any call, so nothing is lost
    m.policy.busy = refs
    return m, refs


def resident(m: PolicyOffloadingManager) -> list[BlockHash]:
    return [h for h, _ in m.policy.ordered_items()]


def hashes_of(items: Iterable[tuple[BlockHash, Any]]) -> list[BlockHash]:
    return [h for h, _ in items]
