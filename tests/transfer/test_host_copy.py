"""HostCopier: every strategy copies exactly the planned rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.transfer.block_map import plan_copy
from kvoffload.transfer.host_copy import HostCopier, RowPair, Strategy

STRATEGIES: list[Strategy] = ["pair", "gather", "scatter"]


def check_copy(
    src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int], how: Strategy
) -> None:
    plan = plan_copy(np.asarray(src_ids, dtype=np.int64), 1, np.asarray(dst_ids, dtype=np.int64), 1)
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = src[s]
    src_before = src.clone()
    assert HostCopier().copy(RowPair.of(src, dst), plan, how) == how
    assert torch.equal(dst, expected)
    assert torch.equal(src, src_before)


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
    assert HostCopier.choose(pair, plan) in ("pair", "gather")
    HostCopier().copy(pair, plan)
    assert torch.equal(dst[[0, 6, 2, 4]], src[[5, 1, 7, 3]])


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "row_words", "expected"),
    [
        (list(range(64)), list(range(100, 164)), 2048, "pair"),  # one run
        (list(np.random.default_rng(0).permutation(64)), list(range(64)), 2048, "gather"),
        (list(range(64)), list(np.random.default_rng(0).permutation(64)), 2048, "scatter"),
        (
            list(np.random.default_rng(1).permutation(64)),
            list(np.random.default_rng(2).permutation(64)),
            2048,
            "pair",
        ),  # both sides scattered: a numpy slice per row is the cheapest call
        (
            list(np.random.default_rng(1).permutation(64)),
            list(np.random.default_rng(2).permutation(64)),
            262144,
            "pair",
        ),  # every strategy moves the bytes once, so row size does not matter
    ],
)
def test_host_copy_choose_follows_the_cost_model(
    src_ids: list[int], dst_ids: list[int], row_words: int, expected: str
) -> None:
    src = torch.empty((200, row_words), dtype=torch.int64)
    plan = plan_copy(np.asarray(src_ids), 1, np.asarray(dst_ids), 1)
    assert HostCopier.choose(RowPair.of(src, src), plan) in expected.split("|")
