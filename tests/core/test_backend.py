"""The CPU backend, block statuses and load/store specs (vLLM-compatible details)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from kvoffload import (
    Backend,
    BlockHash,
    BlockStateError,
    BlockStatus,
    ConfigError,
    CPUBackend,
    GPULoadStoreSpec,
    PolicyOffloadingManager,
)
from kvoffload.backends.cpu import CPUBlockStatus
from kvoffload.mediums import CPULoadStoreSpec
from kvoffload.policies import available_policies

from .fakes import bh, bhs, ids_of


def _ids(blocks: list[BlockStatus]) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def test_cpu_backend_hands_out_fresh_ids_ascending_then_reuses_lifo() -> None:
    b = CPUBackend(block_size=16, num_blocks=6)
    assert b.medium == "CPU" and b.block_size == 16
    first = b.allocate_blocks(bhs(1, 2, 3))
    assert _ids(first) == [0, 1, 2]
    b.free(first[0])
    b.free(first[2])
    assert b.get_num_free_blocks() == 5
    # fresh ids first, then the freed ones, most recently freed first
    assert _ids(b.allocate_blocks(bhs(4, 5, 6, 7))) == [3, 4, 5, 2]
    assert _ids(b.allocate_blocks(bhs(8))) == [0]
    assert b.get_num_free_blocks() == 0


def test_cpu_backend_new_blocks_are_in_flight() -> None:
    (block,) = CPUBackend(16, 1).allocate_blocks(bhs(1))
    assert isinstance(block, CPUBlockStatus)
    assert block.ref_cnt == -1 and not block.is_ready
    block.ref_cnt = 0
    assert block.is_ready


def test_cpu_backend_refuses_to_overallocate() -> None:
    b = CPUBackend(16, 2)
    with pytest.raises(BlockStateError, match="only 2 free"):
        b.allocate_blocks(bhs(1, 2, 3))
    assert b.get_num_free_blocks() == 2


def test_cpu_backend_full_tier_reuses_lifo_and_refuses_to_overallocate() -> None:
    # once every id was handed out once, only freed ids remain (a shorter path)
    b = CPUBackend(16, 4)
    ids = b.allocate_handles(bhs(1, 2, 3, 4))
    assert ids == [0, 1, 2, 3] and b.get_num_free_blocks() == 0
    assert b.allocate_handles([]) == []
    b.free_handles([2, 0, 3])
    with pytest.raises(BlockStateError, match="only 3 free"):
        b.allocate_handles(bhs(5, 6, 7, 8))
    assert b.get_num_free_blocks() == 3  # nothing taken
    assert b.allocate_handles(bhs(5, 6)) == [3, 0]  # most recently freed first
    assert b.allocate_handles(bhs(7)) == [2] and b.get_num_free_blocks() == 0


@pytest.mark.parametrize(("block_size", "num_blocks"), [(0, 4), (16, 0), (-1, 4), (16, 2.5)])
def test_cpu_backend_rejects_bad_sizes(block_size: int, num_blocks: int) -> None:
    with pytest.raises(ConfigError):
        CPUBackend(block_size, num_blocks)


def test_cpu_backend_spec_lists_block_ids_as_int64() -> None:
    b = CPUBackend(16, 4)
    blocks = b.allocate_blocks(bhs(1, 2))
    spec = b.get_load_store_spec(bhs(1, 2), blocks)
    assert isinstance(spec, CPULoadStoreSpec)
    assert spec.medium() == "CPU"
    assert spec.block_ids.dtype == np.int64
    assert ids_of(spec) == [0, 1]
    assert ids_of(b.get_load_store_spec([], [])) == []
    assert b.get_load_store_spec([], []).block_ids.dtype == np.int64


def test_gpu_spec_medium_and_dtype() -> None:
    spec = GPULoadStoreSpec([3, 1, 2])
    assert spec.medium() == "GPU"
    assert spec.block_ids.dtype == np.int64
    assert ids_of(spec) == [3, 1, 2]
    from_array = GPULoadStoreSpec(np.array([5, 6], dtype=np.int32))
    assert from_array.block_ids.dtype == np.int64


def test_cpu_backend_free_blocks_is_free_in_order() -> None:
    b1, b2 = CPUBackend(16, 6), CPUBackend(16, 6)
    x1 = b1.allocate_blocks(bhs(1, 2, 3, 4))
    x2 = b2.allocate_blocks(bhs(1, 2, 3, 4))
    for blk in (x1[2], x1[0], x1[3]):
        b1.free(blk)
    b2.free_blocks([x2[2], x2[0], x2[3]])
    assert b1.allocated_blocks_free_list == b2.allocated_blocks_free_list == [2, 0, 3]
    assert _ids(b2.allocate_blocks(bhs(7, 8, 9, 10))) == [4, 5, 3, 0]
    assert b2.allocated_blocks_free_list == [2]
    assert b2.allocate_blocks([]) == []


def test_cpu_backend_handles_are_block_ids_in_vllm_order() -> None:
    """What a manager keeps per block is the id itself; the vLLM methods and
    the handle methods share one id sequence."""
    b = CPUBackend(16, 4)
    assert b.allocate_handles(bhs(1, 2)) == [0, 1]
    (status,) = b.allocate_blocks(bhs(3))
    assert isinstance(status, CPUBlockStatus) and status.block_id == 2 and status.ref_cnt == -1
    b.free_handles([0, 1])
    b.free(status)
    assert b.allocated_blocks_free_list == [0, 1, 2]
    assert b.allocate_handles(bhs(4, 5, 6)) == [3, 2, 1]  # fresh first, then LIFO
    assert b.get_num_free_blocks() == 1
    spec = b.get_handles_spec(bhs(4, 5), [3, 2])
    assert isinstance(spec, CPULoadStoreSpec) and spec.block_ids.tolist() == [3, 2]
    snap = b.block_status(3, 2)
    assert isinstance(snap, CPUBlockStatus) and (snap.block_id, snap.ref_cnt) == (3, 2)
    with pytest.raises(BlockStateError, match="only 1 free"):
        b.allocate_handles(bhs(7, 8))


def test_cpu_backend_free_rejects_a_foreign_block() -> None:
    with pytest.raises(BlockStateError, match="not a block of this backend"):
        CPUBackend(16, 2).free(BlockStatus())


def test_spec_from_an_id_list_builds_the_same_array_on_first_use() -> None:
    ids = [5, 0, 7]
    spec = CPULoadStoreSpec.from_id_list(ids)
    assert isinstance(spec.block_ids, np.ndarray) and spec.block_ids.dtype == np.int64
    assert spec.block_ids.tolist() == [5, 0, 7]
    assert spec.block_ids is spec.block_ids  # built once
    assert repr(spec) == repr(CPULoadStoreSpec([5, 0, 7]))
    assert CPUBackend(16, 3).get_load_store_spec([], []).block_ids.shape == (0,)


class _SlotStatus(BlockStatus):
    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        super().__init__()
        self.slot = slot


class _VllmStyleBackend(Backend):
    """A backend written against vLLM's interface only: BlockStatus objects
    in and out, no handle methods of its own."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(block_size=16, medium="CPU")
        self.free_slots = list(range(num_blocks))[::-1]

    def get_num_free_blocks(self) -> int:
        return len(self.free_slots)

    def allocate_blocks(self, block_hashes: list[BlockHash]) -> list[BlockStatus]:
        return [_SlotStatus(self.free_slots.pop()) for _ in block_hashes]

    def free(self, block: BlockStatus) -> None:
        assert isinstance(block, _SlotStatus)
        self.free_slots.append(block.slot)

    def get_load_store_spec(
        self, block_hashes: Iterable[BlockHash], blocks: Iterable[BlockStatus]
    ) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([b.slot for b in blocks])  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", available_policies())
def test_a_vllm_style_backend_works_through_the_default_handles(policy: str) -> None:
    backend = _VllmStyleBackend(3)
    m = PolicyOffloadingManager(backend, policy=policy)
    out = m.prepare_store(bhs(1, 2, 3))
    assert out is not None and ids_of(out.store_spec) == [0, 1, 2]
    m.complete_store(bhs(1, 2, 3))
    assert ids_of(m.prepare_load(bhs(2))) == [1]
    status = m.get_block(bh(2))
    assert isinstance(status, _SlotStatus) and (status.slot, status.ref_cnt) == (1, 1)
    slots = {h: m.get_block(h).slot for h in bhs(1, 3)}  # type: ignore[union-attr]
    out = m.prepare_store(bhs(4))  # evicts 1 or 3 (2 is pinned), frees its slot
    assert out is not None and len(out.block_hashes_evicted) == 1
    slot = slots[out.block_hashes_evicted[0]]
    assert ids_of(out.store_spec) == [slot]
    m.complete_store(bhs(4), success=False)  # the failed store's slot comes back
    assert backend.free_slots == [slot]
    m.complete_load(bhs(2))
    assert m.get_block(bh(2)).ref_cnt == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(("args", "name"), [((True, 4), "block_size"), ((16, True), "num_blocks")])
def test_cpu_backend_refuses_bools_as_counts(args: tuple[object, object], name: str) -> None:
    # CPUBackend(True, True) was a tier of one block of one token
    from kvoffload import ConfigError

    with pytest.raises(ConfigError, match=f"{name} must be a positive int, got True"):
        CPUBackend(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["no", 0, None])
def test_manager_enable_events_is_a_bool(value: object) -> None:
    # "no" is truthy: it turned events on
    from kvoffload import ConfigError, PolicyOffloadingManager

    with pytest.raises(ConfigError, match="enable_events must be True or False"):
        PolicyOffloadingManager(CPUBackend(16, 4), enable_events=value)  # type: ignore[arg-type]
