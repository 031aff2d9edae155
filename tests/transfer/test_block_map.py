"""Properties of the block-mapping math, checked against plain-loop references."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native import needs_c
from odd_specs import UnreadableIds, skipless

from kvoffload.abstract import LoadStoreSpec
from kvoffload.errors import ConfigError, TransferError
from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import _native, block_map
from kvoffload.transfer.block_map import (
    PartialCPULoadStoreSpec,
    admit_job,
    consecutive_runs,
    expand_block_ids,
    plan_copy,
    plan_transfer,
)


@pytest.fixture(scope="module", autouse=True, params=["c", "numpy"])
def planner(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test of this module runs with the C planner (where built) and
    with the numpy one it falls back to."""
    if request.param == "c" and _native.rows is None:
        pytest.skip("KVOFFLOAD_PURE_PYTHON is set: no C planner")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "numpy":
            mp.setattr(block_map, "_rows", None)
        yield request.param


def ref_rows(
    block_ids: list[int], factor: int, skip_first: int = 0, skip_last: int = 0
) -> list[int]:
    rows = [b * factor + j for b in block_ids for j in range(factor)]
    return rows[skip_first : len(rows) - skip_last]


def vllm_store_rows(n_gpu: int, cpu_ids: list[int], factor: int) -> list[int]:
    """vLLM 0.11.2's store mapping: skip ``-N % factor`` rows at the start of
    the destination, and assert the counts then match."""
    skip = -n_gpu % factor
    assert n_gpu == len(cpu_ids) * factor - skip
    return ref_rows(cpu_ids, factor, skip)


def vllm_load_rows(cpu_ids: list[int], n_gpu: int, factor: int) -> list[int]:
    """vLLM 0.11.2's load mapping: the GPU side has factor 1, so nothing is
    ever skipped and the counts must match exactly (defect 7)."""
    assert len(cpu_ids) * factor == n_gpu
    return ref_rows(cpu_ids, factor)


@st.composite
def jobs(draw: st.DrawFn, *, aligned_only: bool = False) -> tuple[list[int], list[int], int]:
    """(gpu ids, cpu ids, factor) with counts vLLM's convention accepts."""
    factor = draw(st.integers(1, 5))
    m = draw(st.integers(0, 6))
    lo = m * factor if aligned_only or m == 0 else m * factor - factor + 1
    n = draw(st.integers(lo, m * factor))
    gpu = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
    cpu = draw(st.lists(st.integers(0, 15), min_size=m, max_size=m, unique=True))
    return gpu, cpu, factor


def arr(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


@given(st.lists(st.integers(0, 100), max_size=12), st.integers(1, 6), st.data())
def test_expand_block_ids_matches_loop(ids: list[int], factor: int, data: st.DataObject) -> None:
    total = len(ids) * factor
    first = data.draw(st.integers(0, total))
    last = data.draw(st.integers(0, total - first))
    got = expand_block_ids(arr(ids), factor, first, last)
    assert got.dtype == np.int64
    assert got.tolist() == ref_rows(ids, factor, first, last)


def test_expand_block_ids_docstring_example() -> None:
    assert expand_block_ids(arr([0, 1, 3]), 4, 1).tolist() == [1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]


@given(st.lists(st.integers(0, 30), max_size=30))
def test_consecutive_runs_cover_and_are_maximal(values: list[int]) -> None:
    idx = arr(values)
    runs = consecutive_runs(idx)
    assert int(runs[:, 1].sum()) == len(values)
    rebuilt: list[int] = []
    for p, k in runs.tolist():
        assert k >= 1
        assert idx[p : p + k].tolist() == list(range(values[p], values[p] + k))
        rebuilt.extend(values[p : p + k])
        end = p + k
        if end < len(values):
            assert values[end] != values[end - 1] + 1  # maximal
    assert rebuilt == values


@given(jobs())
def test_plan_transfer_store_matches_vllm(job: tuple[list[int], list[int], int]) -> None:
    gpu, cpu, factor = job
    plan = plan_transfer((GPULoadStoreSpec(gpu), CPULoadStoreSpec(cpu)), factor)
    assert plan.direction == "store"
    assert plan.copy.src.tolist() == gpu
    assert plan.copy.dst.tolist() == vllm_store_rows(len(gpu), cpu, factor)


@given(jobs())
def test_plan_transfer_load_skips_head_of_first_cpu_block(
    job: tuple[list[int], list[int], int],
) -> None:
    gpu, cpu, factor = job
    plan = plan_transfer((CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu)), factor)
    assert plan.direction == "load"
    assert plan.copy.src.tolist() == ref_rows(cpu, factor, len(cpu) * factor - len(gpu))
    assert plan.copy.dst.tolist() == gpu


@given(jobs(aligned_only=True))
def test_plan_transfer_load_matches_vllm_when_aligned(
    job: tuple[list[int], list[int], int],
) -> None:
    gpu, cpu, factor = job
    plan = plan_transfer((CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu)), factor)
    assert plan.copy.src.tolist() == vllm_load_rows(cpu, len(gpu), factor)


def test_plan_transfer_load_from_middle_of_block_defect7() -> None:
    # The GPU prefix hit ends one GPU block into CPU block 4: the load needs
    # the last two sub-blocks of block 4 and all of block 9. vLLM asserts.
    with pytest.raises(AssertionError):
        vllm_load_rows([4, 9], 5, 3)
    plan = plan_transfer((CPULoadStoreSpec([4, 9]), GPULoadStoreSpec([7, 1, 2, 8, 0])), 3)
    assert plan.copy.src.tolist() == [13, 14, 27, 28, 29]
    assert plan.copy.dst.tolist() == [7, 1, 2, 8, 0]


@given(jobs(), st.sampled_from(["store", "load"]))
def test_plan_copy_runs_rebuild_the_pairs(
    job: tuple[list[int], list[int], int], direction: str
) -> None:
    gpu, cpu, factor = job
    spec: tuple[LoadStoreSpec, LoadStoreSpec] = (
        (GPULoadStoreSpec(gpu), CPULoadStoreSpec(cpu))
        if direction == "store"
        else (CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu))
    )
    plan = plan_transfer(spec, factor).copy
    src: list[int] = []
    dst: list[int] = []
    for s, d, k in plan.runs.tolist():
        src.extend(range(s, s + k))
        dst.extend(range(d, d + k))
    assert src == plan.src.tolist()
    assert dst == plan.dst.tolist()
    # maximal: consecutive runs never continue each other on both sides
    for (s0, d0, k0), (s1, d1, _) in zip(plan.runs.tolist(), plan.runs.tolist()[1:], strict=False):
        assert not (s1 == s0 + k0 and d1 == d0 + k0)
    assert len(set(plan.dst.tolist())) == plan.num_rows
    assert plan.num_runs == len(plan.runs)
    assert plan.src_runs.tolist() == consecutive_runs(plan.src).tolist()
    assert plan.dst_runs.tolist() == consecutive_runs(plan.dst).tolist()
    assert plan.num_src_runs == len(plan.src_runs)
    assert plan.num_dst_runs == len(plan.dst_runs)
    assert list(zip(*plan.byte_runs(24), strict=True)) == [
        (s * 24, (s + k) * 24, d * 24) for s, d, k in plan.runs.tolist()
    ]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        pytest.param([], [], id="empty"),
        pytest.param([3, 4, 5], [7, 8, 9], id="one-run"),
        pytest.param([5, 1, 3], [0, 4, 2], id="all-single"),
        pytest.param([0, 1, 5, 6, 9], [2, 3, 7, 8, 0], id="mixed"),
    ],
)
def test_copy_plan_byte_runs_each_shape(src: list[int], dst: list[int]) -> None:
    plan = plan_copy(np.array(src, dtype=np.int64), 1, np.array(dst, dtype=np.int64), 1)
    expected = [(s * 10, (s + k) * 10, d * 10) for s, d, k in plan.runs.tolist()]
    assert list(zip(*plan.byte_runs(10), strict=True)) == expected
    assert plan.byte_runs(10) is plan.byte_runs(10)  # cached for every layer
    assert list(zip(*plan.byte_runs(3), strict=True)) == [
        (s * 3, (s + k) * 3, d * 3) for s, d, k in plan.runs.tolist()
    ]


@given(jobs(), st.integers(1, 7))
def test_plan_transfer_rejects_counts_outside_the_window(
    job: tuple[list[int], list[int], int], extra: int
) -> None:
    gpu, cpu, factor = job
    too_many = [*gpu, *range(100, 100 + extra)]
    if len(cpu) * factor - len(too_many) >= 0:
        return  # still fits; other examples cover it
    with pytest.raises(TransferError, match="cannot pair"):
        plan_transfer((GPULoadStoreSpec(too_many), CPULoadStoreSpec(cpu)), factor)
    with pytest.raises(TransferError, match="cannot pair"):
        plan_transfer((CPULoadStoreSpec(cpu), GPULoadStoreSpec(too_many)), factor)


@settings(max_examples=50)
@given(st.integers(2, 5), st.integers(1, 4), st.data())
def test_plan_transfer_partial_spec_ends_inside_a_block(
    factor: int, m: int, data: st.DataObject
) -> None:
    first = data.draw(st.integers(0, factor - 1))
    last_max = factor - 1 if m > 1 else factor - 1 - first
    last = data.draw(st.integers(0, last_max))
    cpu = data.draw(st.lists(st.integers(0, 20), min_size=m, max_size=m, unique=True))
    n = m * factor - first - last
    gpu = list(range(n))
    partial = PartialCPULoadStoreSpec(cpu, skip_first=first, skip_last=last)
    load = plan_transfer((partial, GPULoadStoreSpec(gpu)), factor).copy
    assert load.src.tolist() == ref_rows(cpu, factor, first, last)
    store = plan_transfer((GPULoadStoreSpec(gpu), partial), factor).copy
    assert store.dst.tolist() == ref_rows(cpu, factor, first, last)


@pytest.mark.parametrize(
    ("ids", "first", "last", "message"),
    [
        ([1], 2, 1, "leaves none"),
        ([1, 2], 3, 0, r"must each lie in \[0, 3\)"),
        ([], 1, 0, "has no blocks"),
    ],
)
def test_plan_transfer_rejects_bad_partial_skips(
    ids: list[int], first: int, last: int, message: str
) -> None:
    spec = PartialCPULoadStoreSpec(ids, skip_first=first, skip_last=last)
    n = max(0, len(ids) * 3 - first - last)
    with pytest.raises(TransferError, match=message):
        plan_transfer((spec, GPULoadStoreSpec(range(n))), 3)


def test_plan_transfer_partial_with_zero_skips_disables_implicit_skip() -> None:
    spec = PartialCPULoadStoreSpec([0, 1])
    with pytest.raises(TransferError, match="cannot pair"):
        plan_transfer((spec, GPULoadStoreSpec([0, 1, 2, 3, 4])), 3)


@pytest.mark.parametrize(
    ("gpu", "cpu", "message"),
    [
        ([0, 64], [0], "out of range"),
        ([-1, 0], [0], "out of range"),
        ([0, 1], [16], "out of range"),
        ([0, 1], [-2], "out of range"),
    ],
)
def test_plan_transfer_rejects_out_of_range_ids(
    gpu: list[int], cpu: list[int], message: str
) -> None:
    with pytest.raises(TransferError, match=message):
        plan_transfer(
            (GPULoadStoreSpec(gpu), CPULoadStoreSpec(cpu)), 2, num_gpu_blocks=64, num_cpu_blocks=16
        )


def test_plan_copy_rejects_negative_ids_without_a_bound() -> None:
    with pytest.raises(TransferError, match=r"\[-3\] are out of range"):
        plan_copy(np.array([0, -3]), 1, np.array([4, 5]), 1)
    with pytest.raises(TransferError, match="out of range"):
        plan_copy(np.array([0, 1]), 1, np.array([4, 2**63 + 1], dtype=np.uint64), 1)


def test_plan_transfer_rejects_repeated_destination_blocks() -> None:
    with pytest.raises(TransferError, match="repeats"):
        plan_transfer((CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 3])), 1)
    with pytest.raises(TransferError, match="repeats"):
        plan_transfer((GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([5, 5])), 2)
    # repeated *sources* are fine: one block copied twice
    plan = plan_transfer((CPULoadStoreSpec([2, 2]), GPULoadStoreSpec([0, 1])), 1)
    assert plan.copy.src.tolist() == [2, 2]


class _DiskSpec(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "DISK"


@pytest.mark.parametrize(
    "spec",
    [
        (GPULoadStoreSpec([0]), GPULoadStoreSpec([1])),
        (CPULoadStoreSpec([0]), CPULoadStoreSpec([1])),
        (_DiskSpec(), GPULoadStoreSpec([1])),
    ],
)
def test_plan_transfer_rejects_unsupported_spec_pairs(
    spec: tuple[LoadStoreSpec, LoadStoreSpec],
) -> None:
    with pytest.raises(TransferError, match="unsupported spec pair"):
        plan_transfer(spec, 2)


def test_plan_copy_rejects_non_1d_ids() -> None:
    with pytest.raises(TransferError, match="1-D integer"):
        plan_copy(np.zeros((2, 2), dtype=np.int64), 1, np.arange(4), 1)
    with pytest.raises(TransferError, match="1-D integer"):
        plan_copy(np.array([0.5]), 1, np.arange(1), 1)


def test_plan_copy_empty_job_has_no_rows() -> None:
    plan = plan_transfer((GPULoadStoreSpec([]), CPULoadStoreSpec([])), 4)
    assert plan.copy.num_rows == 0
    assert plan.copy.runs.shape == (0, 3)


def test_plan_copy_does_not_alias_read_only_spec_arrays() -> None:
    ids = np.arange(4, dtype=np.int64)
    ids.setflags(write=False)
    plan = plan_copy(ids, 1, np.arange(4, 8), 1)
    assert plan.src.flags.writeable
    assert not np.shares_memory(plan.src, ids)


class ForeignBlockIDsSpec:
    """Shaped like vLLM 0.11.2's ``BlockIDsLoadStoreSpec``: a plain
    ``block_ids`` array and a static ``medium()``, no kvoffload base class."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)


class ForeignGPUSpec(ForeignBlockIDsSpec):
    @staticmethod
    def medium() -> str:
        return "GPU"


class ForeignCPUSpec(ForeignBlockIDsSpec):
    @staticmethod
    def medium() -> str:
        return "CPU"


def test_plan_transfer_reads_any_spec_by_medium_and_block_ids() -> None:
    ours = plan_transfer((GPULoadStoreSpec([3, 5, 6]), CPULoadStoreSpec([1, 2])), 2)
    theirs = plan_transfer((ForeignGPUSpec([3, 5, 6]), ForeignCPUSpec([1, 2])), 2)  # type: ignore[arg-type]
    mixed = plan_transfer((ForeignGPUSpec([3, 5, 6]), CPULoadStoreSpec([1, 2])), 2)  # type: ignore[arg-type]
    for plan in (theirs, mixed):
        assert plan.direction == ours.direction == "store"
        assert plan.copy.src.tolist() == ours.copy.src.tolist()
        assert plan.copy.dst.tolist() == ours.copy.dst.tolist()
    load = plan_transfer((CPULoadStoreSpec([4]), ForeignGPUSpec([7, 1])), 2)  # type: ignore[arg-type]
    assert load.direction == "load"
    assert (load.copy.src.tolist(), load.copy.dst.tolist()) == ([8, 9], [7, 1])


def test_plan_transfer_refusal_names_both_classes_with_modules() -> None:
    here = __name__
    with pytest.raises(TransferError) as info:
        plan_transfer((ForeignCPUSpec([0]), CPULoadStoreSpec([1])), 1)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"{here}.ForeignCPUSpec (medium 'CPU')" in message
    assert "kvoffload.mediums.CPULoadStoreSpec (medium 'CPU')" in message
    assert "'GPU' -> 'CPU' (store) or 'CPU' -> 'GPU' (load)" in message


def test_plan_transfer_refuses_specs_without_medium_or_block_ids() -> None:
    with pytest.raises(TransferError, match=rf"{__name__}.ForeignBlockIDsSpec \(medium None\)"):
        plan_transfer((ForeignBlockIDsSpec([0]), CPULoadStoreSpec([1])), 1)  # type: ignore[arg-type]

    class NoIds:
        @staticmethod
        def medium() -> str:
            return "GPU"

    with pytest.raises(TransferError, match=r"NoIds \(medium 'GPU'\) -> kvoffload"):
        plan_transfer((NoIds(), CPULoadStoreSpec([1])), 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("first", "last", "message"),
    [
        (2.9, 0, "skip_first must be an int >= 0, got 2.9"),
        (0, "1", "skip_last must be an int >= 0, got '1'"),
        (True, 0, "skip_first must be an int >= 0, got True"),
        (0, -1, "skip_last must be an int >= 0, got -1"),
        (None, 0, "skip_first must be an int >= 0, got None"),
    ],
)
def test_partial_spec_refuses_skips_that_are_not_ints_from_zero(
    first: object, last: object, message: str
) -> None:
    # once rounded or parsed (2.9 -> 2, "1" -> 1, True -> 1): wrong sub-blocks copied
    with pytest.raises(ConfigError, match=re.escape(message)):
        PartialCPULoadStoreSpec([0, 1], skip_first=first, skip_last=last)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape(message)):
        PartialCPULoadStoreSpec.from_id_list([0, 1], skip_first=first, skip_last=last)  # type: ignore[arg-type]


def test_partial_spec_from_id_list_keeps_its_skips() -> None:
    # the inherited constructor built a spec without skip_first / skip_last
    plain = PartialCPULoadStoreSpec.from_id_list([0, 1])
    assert repr(plain) == "PartialCPULoadStoreSpec([0, 1], skip_first=0, skip_last=0)"
    spec = PartialCPULoadStoreSpec.from_id_list([4, 2], skip_first=1, skip_last=2)
    assert repr(spec) == "PartialCPULoadStoreSpec([4, 2], skip_first=1, skip_last=2)"
    load = plan_transfer((spec, GPULoadStoreSpec(range(3))), 3).copy
    assert load.src.tolist() == ref_rows([4, 2], 3, 1, 2)


@pytest.mark.parametrize(
    ("cpu_spec", "message"),
    [
        pytest.param(skipless(), "skips must be ints, got skip_first=None", id="no-skips"),
        pytest.param(UnreadableIds([0]), "block ids lost", id="unreadable-ids"),
    ],
)
def test_admit_job_refuses_a_spec_that_cannot_be_read(
    cpu_spec: CPULoadStoreSpec, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    for spec in ((GPULoadStoreSpec([0]), cpu_spec), (cpu_spec, GPULoadStoreSpec([0]))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvoffload.transfer.block_map"):
            assert admit_job(3, spec, 1, ()) is None
        assert "transfer 3 refused" in caplog.text and message in caplog.text


# -- the C planner against the numpy one ------------------------------------------


def _outcome(*args: object, **kwargs: object) -> tuple[list[int], list[int]] | str:
    try:
        plan = plan_copy(*args, **kwargs)  # type: ignore[arg-type]
    except TransferError as exc:
        return str(exc)
    assert plan.src.dtype == plan.dst.dtype == np.int64
    return plan.src.tolist(), plan.dst.tolist()


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[tuple[object, ...], dict[str, object]]:
    """plan_copy arguments near the edge of valid: counts that pair (or miss
    by one), ids up to one past their bound or below zero, repeats, skips
    implicit or explicit (possibly too large)."""
    rows = draw(st.integers(0, 8))
    args: list[object] = []
    kwargs: dict[str, object] = {}
    for side in ("src", "dst"):
        factor = draw(st.integers(1, 3))
        n = -(-rows // factor) + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        limit = draw(st.none() | st.integers(0, 12))
        top = 12 if limit is None else limit
        unique = draw(st.booleans()) and n <= top + 2
        ids = draw(
            st.lists(st.integers(-1, top), min_size=max(0, n), max_size=max(0, n), unique=unique)
        )
        skip = draw(st.none() | st.tuples(st.integers(0, factor), st.integers(0, factor)))
        args += [arr(ids), factor]
        kwargs[f"{side}_skip"], kwargs[f"{side}_num_blocks"] = skip, limit
    return tuple(args), kwargs


@needs_c
@settings(max_examples=300)
@given(plan_inputs())
def test_the_c_planner_plans_or_refuses_exactly_as_numpy_does(
    planner: str, inputs: tuple[tuple[object, ...], dict[str, object]]
) -> None:
    """Any ids (out of range, negative, repeated), skips and bounds: the same
    rows or the same error from both planners."""
    args, kwargs = inputs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(block_map, "_rows", _native.rows)
        by_c = _outcome(*args, **kwargs)
        mp.setattr(block_map, "_rows", None)
        by_numpy = _outcome(*args, **kwargs)
    assert by_c == by_numpy


@needs_c
def test_the_c_planner_answers_valid_jobs_itself(planner: str) -> None:
    """A valid job never reaches the numpy checks (they are what it saves)."""
    assert _native.rows is not None
    src, dst = np.empty(5, dtype=np.int64), np.empty(5, dtype=np.int64)
    ok = _native.rows.plan_rows(
        arr([7, 2]), 3, 1, 0, 8, arr([4, 0, 9, 1, 3]), 1, 0, 0, -1, src, dst
    )
    assert ok is True
    assert src.tolist() == [22, 23, 6, 7, 8] and dst.tolist() == [4, 0, 9, 1, 3]
    for bad_dst, limit in (([4, 0, 4, 1, 3], -1), ([4, 0, 9, 1, 3], 9), ([4, 0, -9, 1, 3], -1)):
        assert not _native.rows.plan_rows(
            arr([7, 2]), 3, 1, 0, 8, arr(bad_dst), 1, 0, 0, limit, src, dst
        )
    if planner == "c":
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(block_map, "_check_ids", None)  # calling it would raise
            assert plan_copy(arr([7, 2]), 3, arr([4, 0, 9, 1, 3]), 1).num_rows == 5


@needs_c
def test_plan_rows_refuses_malformed_arguments(planner: str) -> None:
    assert _native.rows is not None
    plan_rows = _native.rows.plan_rows
    out = np.empty(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"src factor 0 must be >= 1"):
        plan_rows(arr([1]), 0, 0, 0, -1, arr([1, 2]), 1, 0, 0, -1, out, out.copy())
    with pytest.raises(ValueError, match=r"dst factor 2 .* skips \(2, 0\)"):
        plan_rows(arr([1, 2]), 1, 0, 0, -1, arr([1]), 2, 2, 0, -1, out, out.copy())
    with pytest.raises(ValueError, match="src_ids has 3 ids x1 skipping 0\\+0 rows: 2 outs"):
        plan_rows(arr([1, 2, 3]), 1, 0, 0, -1, arr([1, 2]), 1, 0, 0, -1, out, out.copy())
    frozen = out.copy()
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="dst_out must be writable"):
        plan_rows(arr([1, 2]), 1, 0, 0, -1, arr([1, 2]), 1, 0, 0, -1, out, frozen)
    with pytest.raises(TypeError, match="src_ids must be a contiguous buffer of int64"):
        plan_rows(np.arange(2, dtype=np.int32), 1, 0, 0, -1, arr([1, 2]), 1, 0, 0, -1, out, out)
    with pytest.raises(TypeError, match="takes 12 positional arguments"):
        plan_rows(arr([1]))


def test_plan_copy_takes_bounds_and_factors_beyond_int64() -> None:
    """What the C planner cannot hold it hands to numpy (no OverflowError)."""
    assert plan_copy(arr([0, 1]), 1, arr([0, 1]), 1, src_num_blocks=2**70).num_rows == 2
    with pytest.raises(
        TransferError,
        match=r"\[0, 1\] are out of range \[0, 0\) \(past it a block's 1180591620717411303424 rows",
    ):
        plan_copy(arr([0, 1]), 2**70, arr([0, 1]), 1)


def test_plan_copy_refuses_ids_whose_rows_pass_int64() -> None:
    """Rows are int64: block ``b`` of ``factor`` rows is refused once its
    last row, ``b * factor + factor - 1``, would wrap (numpy wrapped it to
    a small row that overlapped block 0's)."""
    last = (2**63 - 1 - 3) // 4  # the last block of 4 rows whose rows fit
    plan = plan_copy(arr([last]), 4, arr([0, 1, 2, 3]), 1, src_num_blocks=2**63 - 1)
    assert plan.src.tolist() == [2**63 - 4, 2**63 - 3, 2**63 - 2, 2**63 - 1]
    for bound in (None, 2**63 - 1):
        with pytest.raises(
            TransferError, match=rf"\[{last + 1}\] are out of range \[0, {last + 1}\)"
        ):
            plan_copy(arr([last + 1]), 4, arr([0, 1, 2, 3]), 1, src_num_blocks=bound)


@pytest.mark.parametrize(
    ("kwargs", "outcome"),
    [
        ({"src_num_blocks": 5.0}, ([1, 2], [0, 1])),  # a float bound: numpy takes it
        ({"src_skip": (0, 0, 0)}, "too many values to unpack"),  # not a pair
    ],
)
def test_odd_arguments_get_the_numpy_planners_answer(
    kwargs: dict[str, object], outcome: tuple[list[int], list[int]] | str
) -> None:
    try:
        plan = plan_copy(arr([1, 2]), 1, arr([0, 1]), 1, **kwargs)  # type: ignore[arg-type]
        got: tuple[list[int], list[int]] | str = (plan.src.tolist(), plan.dst.tolist())
    except ValueError as exc:
        got = str(exc)
    assert got == outcome or (isinstance(outcome, str) and outcome in str(got))


def test_plan_copy_takes_unaligned_id_buffers() -> None:
    """An int64 view at an odd address is refused by the C planner (reading
    it is undefined behaviour in C) and planned by numpy instead."""
    raw = np.zeros(8 * 3 + 1, dtype=np.uint8)
    ids = raw[1:].view(np.int64)
    ids[:] = [4, 0, 2]
    assert not ids.flags.aligned
    plan = plan_copy(ids, 2, arr([0, 1, 2, 3, 4, 5]), 1)
    assert plan.src.tolist() == [8, 9, 0, 1, 4, 5]
    if _native.rows is not None:
        out = np.empty(6, dtype=np.int64)
        with pytest.raises(TypeError, match="src_ids must be 8-byte aligned"):
            _native.rows.plan_rows(
                ids, 2, 0, 0, -1, arr([0, 1, 2, 3, 4, 5]), 1, 0, 0, -1, out, out.copy()
            )
