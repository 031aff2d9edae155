"""Block-hash builders, state capture and a counting backend shared by the core tests."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from kvoffload import BlockHash, PolicyOffloadingManager, PrepareStoreOutput
from kvoffload.backends.cpu import CPUBackend
from kvoffload.policies import EvictionPolicy
from kvoffload.table import TAGS, PyBlockTable, TableList


def _tables() -> list[type]:
    """Both block tables, the C one unless KVOFFLOAD_PURE_PYTHON is set: a
    missing extension is an error (it is built by ``pip install``)."""
    if os.environ.get("KVOFFLOAD_PURE_PYTHON", "") not in ("", "0"):
        return [PyBlockTable]
    from kvoffload._table import BlockTable

    return [PyBlockTable, BlockTable]


#: the block table implementations under test
TABLES = _tables()


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


def table_state(table: Any) -> dict[str, Any]:
    """Every list of a block table in order (with each block's reference
    count) and the counts."""
    return {
        "lists": [[(h, handle, table.ref(h)) for h, handle in table.items(t)] for t in range(TAGS)],
        "counts": (len(table), table.pinned, table.in_flight),
    }


def policy_state(policy: EvictionPolicy) -> dict[str, Any]:
    """Everything a policy holds: its table's lists, each dict attribute as
    an ordered item list (so order changes show), other attributes as they
    are (the list views are covered by the table)."""
    state: dict[str, Any] = {"table": table_state(policy.table)}
    for name, value in vars(policy).items():
        if name == "table" or isinstance(value, TableList):
            continue
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


class WalkCounter:
    """The entries a manager's evictions examined (the table's ``walked``)
    since the last ``reads = 0``: what vLLM's rescans of busy blocks cost."""

    def __init__(self, m: PolicyOffloadingManager) -> None:
        self._table = m.table
        self._base = self._table.walked

    @property
    def reads(self) -> int:
        return int(self._table.walked - self._base)

    @reads.setter
    def reads(self, value: int) -> None:
        assert value == 0, "only a reset to 0 is meaningful"
        self._base = self._table.walked


def counting_manager(
    capacity: int, policy: str = "lru"
) -> tuple[PolicyOffloadingManager, WalkCounter]:
    """A manager and the count of entries its evictions examine."""
    m = PolicyOffloadingManager(CPUBackend(16, capacity), policy=policy)
    return m, WalkCounter(m)


def resident(m: PolicyOffloadingManager) -> list[BlockHash]:
    return [h for h, _ in m.policy.ordered_items()]


def hashes_of(items: Iterable[tuple[BlockHash, Any]]) -> list[BlockHash]:
    return [h for h, _ in items]
