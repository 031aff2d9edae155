"""HostCopier: every strategy copies exactly the planned rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.transfer.block_map import plan_copy
from kvoffload.transfer.host_copy import HostCopier, RowPair, Strategy

STRATEGIES: list[Strategy] = ["bytes", "pair", "gather", "scatter"]


def check_copy(
    src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int], how: Strategy
) -> None:
    plan = plan_copy(np.asarray(src_ids, dtype=np.int64), 1, np.asarray(dst_ids, dtype=np.int64), 1)
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = src[s]
    src_before = src.clone()
    assert HostCopier().copy(RowPair.of(src, dst), plan, how) == how
    assert torch.equal(raw_bytes(dst), raw_bytes(expected))
    assert torch.equal(raw_bytes(src), raw_bytes(src_before))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t``: unlike values, equal for equal NaN payloads."""
    return t.contiguous().view(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(STRATEGIES),
    st.integers(0, 12),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_host_copy_each_strategy_copies_planned_rows(
    how: Strategy, n: int, seed: int, sorted_ids: bool
) -> None:
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(-(2**62), 2**62, (16, 5)))
    dst = torch.from_numpy(rng.integers(-(2**62), 2**62, (16, 5)))
    src_ids = rng.choice(16, n, replace=False)
    dst_ids = rng.choice(16, n, replace=False)
    if sorted_ids:
        src_ids.sort()
        dst_ids.sort()
    check_copy(src, dst, src_ids.tolist(), dst_ids.tolist(), how)


def test_host_copy_bfloat16_never_picks_numpy_strategies() -> None:
    src = torch.randn(8, 4).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    plan = plan_copy(np.array([5, 1, 7, 3]), 1, np.array([0, 6, 2, 4]), 1)
    pair = RowPair.of(src, dst)
    assert pair.src_np is None
    assert pair.src_bytes is not None  # raw bytes need no numpy dtype
    assert HostCopier.choose(pair, plan) in ("bytes", "pair", "gather")
    HostCopier().copy(pair, plan)
    assert torch.equal(dst[[0, 6, 2, 4]], src[[5, 1, 7, 3]])


def test_host_copy_non_contiguous_rows_have_no_byte_view() -> None:
    base = torch.arange(16 * 6, dtype=torch.int64).reshape(16, 6)
    src = base[:, ::2]  # rows are not byte ranges
    dst = torch.zeros((16, 3), dtype=torch.int64)
    pair = RowPair.of(src, dst)
    assert pair.src_bytes is None and pair.dst_bytes is not None
    plan = plan_copy(np.array([9, 2, 4]), 1, np.array([1, 7, 3]), 1)
    assert HostCopier.choose(pair, plan) != "bytes"
    with pytest.raises(ValueError, match="bytes strategy"):
        HostCopier().copy(pair, plan, "bytes")
    check_copy(src, dst, [9, 2, 4], [1, 7, 3], "pair")


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64]),
    st.integers(1, 7),
    st.integers(0, 2**32 - 1),
)
def test_host_copy_bytes_is_exact_for_any_row_width(
    dtype: torch.dtype, width: int, seed: int
) -> None:
    """Byte offsets scale with the row size; odd widths catch a wrong scale."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (2, 24 * width * dtype.itemsize), dtype=torch.uint8, generator=gen)
    src, dst = (r.view(dtype).reshape(24, width) for r in raw)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 24))
    src_ids = np.sort(rng.choice(24, n, replace=False)) if seed % 2 else rng.choice(24, n, False)
    dst_ids = rng.choice(24, n, replace=False)
    check_copy(src, dst, src_ids.tolist(), dst_ids.tolist(), "bytes")


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "row_words", "threads", "expected"),
    [
        (list(range(64)), list(range(100, 164)), 2048, 1, "bytes"),  # one run
        # One long run with spare threads: torch splits the copy over them.
        (list(range(64)), list(range(100, 164)), 2048, 2, "pair"),
        (list(range(4)), list(range(100, 104)), 16, 2, "bytes"),  # too small to split
        (list(np.random.default_rng(0).permutation(64)), list(range(64)), 2048, 1, "gather"),
        (list(range(64)), list(np.random.default_rng(0).permutation(64)), 2048, 1, "scatter"),
        (
            list(np.random.default_rng(1).permutation(64)),
            list(np.random.default_rng(2).permutation(64)),
            2048,
            1,
            "bytes",
        ),  # both sides scattered: a byte slice per row is the cheapest call
        (
            list(np.random.default_rng(1).permutation(64)),
            list(np.random.default_rng(2).permutation(64)),
            262144,
            1,
            "bytes",
        ),  # every strategy moves the bytes once, so row size does not matter
    ],
)
def test_host_copy_choose_follows_the_cost_model(
    src_ids: list[int], dst_ids: list[int], row_words: int, threads: int, expected: str
) -> None:
    src = torch.empty((200, row_words), dtype=torch.int64)
    plan = plan_copy(np.asarray(src_ids), 1, np.asarray(dst_ids), 1)
    assert HostCopier.choose(RowPair.of(src, src), plan, threads) == expected


def test_host_copy_choose_defaults_to_torch_thread_count() -> None:
    src = torch.empty((200, 2048), dtype=torch.int64)
    plan = plan_copy(np.arange(64), 1, np.arange(100, 164), 1)
    pair = RowPair.of(src, src)
    threads = torch.get_num_threads()
    assert HostCopier.choose(pair, plan) == HostCopier.choose(pair, plan, threads)
