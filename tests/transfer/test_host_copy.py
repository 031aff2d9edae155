"""HostCopier: every strategy copies exactly the planned rows, the ``bytes``
strategy with the C row copier and with the pure-Python loop; and the C row
copier's own contract (``kvoffload.transfer._rows.copy_rows``)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native import needs_c

from kvoffload.transfer.block_map import plan_copy
from kvoffload.transfer.host_copy import HostCopier, RowCopier, RowPair, Strategy, c_copy_rows

STRATEGIES: list[Strategy] = ["bytes", "pair", "gather", "scatter"]
#: the bytes strategy's implementations: the C row copier, the Python loop
COPIERS = [pytest.param(c_copy_rows, id="c", marks=needs_c), pytest.param(None, id="python")]


def check_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: list[int],
    dst_ids: list[int],
    how: Strategy,
    copier: RowCopier | None = c_copy_rows,
) -> None:
    plan = plan_copy(np.asarray(src_ids, dtype=np.int64), 1, np.asarray(dst_ids, dtype=np.int64), 1)
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        expected[d] = src[s]
    src_before = src.clone()
    assert HostCopier(copier).copy(RowPair.of(src, dst), plan, how) == how
    assert torch.equal(raw_bytes(dst), raw_bytes(expected))
    assert torch.equal(raw_bytes(src), raw_bytes(src_before))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t``: unlike values, equal for equal NaN payloads."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("copier", COPIERS)
@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(STRATEGIES),
    st.integers(0, 12),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_host_copy_each_strategy_copies_planned_rows(
    copier: RowCopier | None, how: Strategy, n: int, seed: int, sorted_ids: bool
) -> None:
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(-(2**62), 2**62, (16, 5)))
    dst = torch.from_numpy(rng.integers(-(2**62), 2**62, (16, 5)))
    src_ids = rng.choice(16, n, replace=False)
    dst_ids = rng.choice(16, n, replace=False)
    if sorted_ids:
        src_ids.sort()
        dst_ids.sort()
    check_copy(src, dst, src_ids.tolist(), dst_ids.tolist(), how, copier)


def test_host_copy_bfloat16_never_picks_numpy_strategies() -> None:
    src = torch.randn(8, 4).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    plan = plan_copy(np.array([5, 1, 7, 3]), 1, np.array([0, 6, 2, 4]), 1)
    pair = RowPair.of(src, dst)
    assert pair.src_np is None
    assert pair.src_bytes is not None  # raw bytes need no numpy dtype
    assert HostCopier().choose(pair, plan) in ("bytes", "pair", "gather")
    HostCopier().copy(pair, plan)
    assert torch.equal(dst[[0, 6, 2, 4]], src[[5, 1, 7, 3]])


def test_host_copy_non_contiguous_rows_have_no_byte_view() -> None:
    base = torch.arange(16 * 6, dtype=torch.int64).reshape(16, 6)
    src = base[:, ::2]  # rows are not byte ranges
    dst = torch.zeros((16, 3), dtype=torch.int64)
    pair = RowPair.of(src, dst)
    assert pair.src_bytes is None and pair.dst_bytes is not None
    plan = plan_copy(np.array([9, 2, 4]), 1, np.array([1, 7, 3]), 1)
    assert HostCopier().choose(pair, plan) != "bytes"
    with pytest.raises(ValueError, match="bytes strategy"):
        HostCopier().copy(pair, plan, "bytes")
    check_copy(src, dst, [9, 2, 4], [1, 7, 3], "pair")


@pytest.mark.parametrize("copier", COPIERS)
@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64]),
    st.integers(1, 7),
    st.integers(0, 2**32 - 1),
)
def test_host_copy_bytes_is_exact_for_any_row_width(
    copier: RowCopier | None, dtype: torch.dtype, width: int, seed: int
) -> None:
    """Byte offsets scale with the row size; odd widths catch a wrong scale."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (2, 24 * width * dtype.itemsize), dtype=torch.uint8, generator=gen)
    src, dst = (r.view(dtype).reshape(24, width) for r in raw)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 24))
    src_ids = np.sort(rng.choice(24, n, replace=False)) if seed % 2 else rng.choice(24, n, False)
    dst_ids = rng.choice(24, n, replace=False)
    check_copy(src, dst, src_ids.tolist(), dst_ids.tolist(), "bytes", copier)


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
    """The model with the pure-Python loop (0.09 us a run)."""
    src = torch.empty((200, row_words), dtype=torch.int64)
    plan = plan_copy(np.asarray(src_ids), 1, np.asarray(dst_ids), 1)
    assert HostCopier(None).choose(RowPair.of(src, src), plan, threads) == expected


@needs_c
@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "threads", "expected"),
    [
        # a memcpy a row beats one torch or numpy call for the whole side
        (list(np.random.default_rng(0).permutation(64)), list(range(64)), 1, "bytes"),
        (list(range(64)), list(np.random.default_rng(0).permutation(64)), 1, "bytes"),
        # one long run with spare threads: torch still splits it over them
        (list(range(64)), list(range(100, 164)), 2, "pair"),
    ],
)
def test_host_copy_choose_with_the_c_row_copier(
    src_ids: list[int], dst_ids: list[int], threads: int, expected: str
) -> None:
    src = torch.empty((200, 2048), dtype=torch.int64)
    plan = plan_copy(np.asarray(src_ids), 1, np.asarray(dst_ids), 1)
    assert HostCopier().choose(RowPair.of(src, src), plan, threads) == expected


def test_host_copy_choose_defaults_to_torch_thread_count() -> None:
    src = torch.empty((200, 2048), dtype=torch.int64)
    plan = plan_copy(np.arange(64), 1, np.arange(100, 164), 1)
    pair = RowPair.of(src, src)
    threads = torch.get_num_threads()
    copier = HostCopier()
    assert copier.choose(pair, plan) == copier.choose(pair, plan, threads)


# -- the C row copier itself --------------------------------------------------------


@needs_c
def test_the_handlers_copier_is_the_c_one_unless_told_otherwise() -> None:
    assert HostCopier().row_copier is c_copy_rows is not None
    # docs/performance.md: the row copier is the C one exactly when the table is
    code = (
        "from kvoffload.table import IMPLEMENTATION\n"
        "from kvoffload.transfer.host_copy import c_copy_rows\n"
        "print(IMPLEMENTATION, c_copy_rows)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KVOFFLOAD_PURE_PYTHON": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "python None"


def rows_of(t: torch.Tensor) -> memoryview:
    return t.view(torch.uint8).reshape(-1).numpy().data


@needs_c
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32 - 1), st.booleans())
def test_c_copy_rows_matches_a_row_by_row_copy(row_bytes: int, seed: int, runs: bool) -> None:
    """Any row width, any pairing (runs of consecutive rows or scattered,
    repeated source rows); rows not named stay as they were."""
    assert c_copy_rows is not None
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, (30, row_bytes), dtype=np.uint8)
    dst = rng.integers(0, 256, (20, row_bytes), dtype=np.uint8)
    n = int(rng.integers(0, 21))
    dst_rows = rng.permutation(20)[:n].astype(np.int64)
    src_rows = rng.integers(0, 30, n).astype(np.int64)
    if runs:
        dst_rows.sort()
        src_rows = np.arange(n, dtype=np.int64) + int(rng.integers(0, 30 - n + 1))
    expected = dst.copy()
    expected[dst_rows] = src[src_rows]
    src_before = src.copy()
    count = c_copy_rows(src.data, dst.data, src_rows, dst_rows, row_bytes)
    assert np.array_equal(dst, expected)
    assert np.array_equal(src, src_before)
    breaks = (np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)
    assert count == (0 if n == 0 else 1 + int(breaks.sum()))


@needs_c
def test_c_copy_rows_is_exact_on_jobs_that_release_the_gil() -> None:
    """At 1 MiB and more the copy runs with the GIL released (the branch this
    takes; that the GIL is free then is not observed here): still exact."""
    assert c_copy_rows is not None
    src = torch.randint(0, 2**31, (512, 1024), dtype=torch.int64)  # 4 MiB, 8 KiB rows
    dst = torch.zeros_like(src)
    perm = np.random.default_rng(3).permutation(512)
    src_rows = perm.astype(np.int64)
    dst_rows = np.arange(512, dtype=np.int64)
    assert c_copy_rows(rows_of(src), rows_of(dst), src_rows, dst_rows, 8192) == 512
    assert torch.equal(dst, src[torch.from_numpy(perm)])


@needs_c
def test_c_copy_rows_refuses_bad_input_and_copies_nothing() -> None:
    assert c_copy_rows is not None
    copy_rows = c_copy_rows
    src = np.arange(64, dtype=np.uint8)  # 8 rows of 8 bytes
    dst = np.zeros(32, dtype=np.uint8)  # 4 rows
    ok = np.array([0, 1], dtype=np.int64)
    with pytest.raises(
        IndexError, match=r"dst_rows\[1\] = 4 is out of range for a destination of 4"
    ):
        copy_rows(src.data, dst.data, ok, np.array([3, 4], dtype=np.int64), 8)
    with pytest.raises(IndexError, match=r"src_rows\[0\] = -1 is out of range for a source of 8"):
        copy_rows(src.data, dst.data, np.array([-1, 2], dtype=np.int64), ok, 8)
    assert not dst.any()  # the row before the bad one was not copied either
    with pytest.raises(ValueError, match="equally long, got 2 and 1"):
        copy_rows(src.data, dst.data, ok, ok[:1], 8)
    with pytest.raises(TypeError, match="src_rows must be a contiguous buffer of int64"):
        copy_rows(src.data, dst.data, ok.astype(np.int32), ok, 8)
    with pytest.raises(ValueError, match="row_bytes must be positive, got 0"):
        copy_rows(src.data, dst.data, ok, ok, 0)
    with pytest.raises(BufferError, match="not writable"):
        copy_rows(src.data, bytes(32), ok, ok, 8)
    with pytest.raises(TypeError, match="takes 5 positional arguments"):
        copy_rows(src.data, dst.data, ok, ok)  # type: ignore[call-arg]
    strided = np.arange(4, dtype=np.int64)[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        copy_rows(src.data, dst.data, strided, ok, 8)
    assert not dst.any()


@needs_c
def test_c_copy_rows_within_one_buffer_is_a_memmove_per_run() -> None:
    """Overlapping source and destination (the same buffer): each run is
    copied as memmove would, in order."""
    assert c_copy_rows is not None
    buf = np.arange(40, dtype=np.uint8)  # 10 rows of 4 bytes
    expected = buf.copy()
    expected.reshape(10, 4)[2:6] = expected.reshape(10, 4)[0:4].copy()
    assert c_copy_rows(buf.data, buf.data, np.arange(4), np.arange(2, 6), 4) == 1
    assert np.array_equal(buf, expected)


@needs_c
def test_c_copy_rows_rechecks_indices_a_copy_overwrites() -> None:
    """dst holds dst_rows' own bytes: copying row 0 rewrites dst_rows[1] to
    3, past dst's 2 rows. The copy stops there with a RuntimeError instead of
    writing outside dst (it wrote into the word after it)."""
    assert c_copy_rows is not None
    backing = np.array([1, 0, -7, -7], dtype=np.int64)
    dst_rows = backing[:2]
    src = np.array([3, 42], dtype=np.int64)
    with pytest.raises(RuntimeError, match="changed during the copy"):
        c_copy_rows(
            memoryview(src).cast("B"),
            memoryview(dst_rows).cast("B"),
            np.array([0, 1], dtype=np.int64),
            dst_rows,
            8,
        )
    assert backing.tolist() == [1, 3, -7, -7]  # the first row copied, nothing outside


@needs_c
def test_c_copy_rows_refuses_unaligned_indices() -> None:
    assert c_copy_rows is not None
    raw = np.zeros(8 * 2 + 1, dtype=np.uint8)
    rows = raw[1:].view(np.int64)
    with pytest.raises(TypeError, match="dst_rows must be 8-byte aligned"):
        c_copy_rows(b"x" * 16, bytearray(16), np.array([0, 1], dtype=np.int64), rows, 8)
