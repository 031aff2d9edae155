"""kvoffload's tier inside a real vLLM 0.11.2 engine, on vLLM's CPU platform."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvoffload import ConfigError, available_policies
from kvoffload.transfer.layout import resolve_layouts

from .workload import (
    GPU_BLOCK_SIZE,
    NUM_GPU_BLOCKS,
    PREFIX_TOKENS,
    Run,
    failing_engine_start,
    free_port,
    kvoffload_extra,
    make_llm,
    midblock_prompts,
    run_workload,
)

Offloaded = Callable[..., Run]
BIG_TIER = 256  # offloaded blocks: everything the workload stores fits


@pytest.mark.parametrize("policy", available_policies())
def test_engine_outputs_identical_with_and_without_the_tier(
    policy: str, baseline: Run, offloaded: Offloaded
) -> None:
    run = offloaded(num_cpu_blocks=BIG_TIER, eviction_policy=policy)
    assert run.stats.policy == policy
    assert run.outputs() == baseline.outputs()
    # greedy outputs that differ between prompts, so equality says something
    assert len(set(baseline.outputs().values())) == 6  # a and a_again agree


@pytest.mark.parametrize("policy", available_policies())
def test_engine_prefix_pushed_out_of_gpu_comes_back_from_the_tier(
    policy: str, baseline: Run, offloaded: Offloaded
) -> None:
    # without the tier, vLLM lost the prefix: four prompts of 20 blocks
    # each went through its 64-block cache after A
    assert baseline.steps["a_again"].cached_tokens == 0
    run = offloaded(num_cpu_blocks=BIG_TIER, eviction_policy=policy)
    step = run.steps["a_again"]
    assert step.cached_tokens == PREFIX_TOKENS
    blocks = PREFIX_TOKENS // GPU_BLOCK_SIZE
    # vLLM's count, the manager's and the handler's agree on the blocks
    assert step.hit_blocks == step.load_blocks == blocks
    assert step.transferred("load") == blocks
    assert {(n, b) for d, n, b, _ in step.transfers if d == "load"} == {
        (blocks, blocks * run.gpu_block_bytes)
    }
    assert run.stats.counters.evictions == {k: 0 for k in run.stats.counters.evictions}
    # P went in before A came back (vLLM stores a request's blocks as its
    # steps complete them, so some land during the next prompt's generate)
    before = ("a", "x1", "x2", "x3", "x4")
    assert sum(run.steps[n].transferred("store") for n in before) >= blocks
    assert sum(run.steps[n].load_blocks for n in before) == 0


def test_engine_handler_layout_comes_from_vllm_attention_backends(offloaded: Offloaded) -> None:
    run = offloaded(num_cpu_blocks=BIG_TIER, eviction_policy="lru")
    assert set(run.layouts.values()) == {"kv_first"}
    assert run.num_gpu_blocks == NUM_GPU_BLOCKS
    # vLLM's CPU cache shape alone reads two ways (64 blocks K/V-split, or 2
    # blocks): without the backends the handler could not tell
    with pytest.raises(ConfigError, match="ambiguous KV layout"):
        resolve_layouts(run.shapes)


def test_engine_small_tier_evicts_and_keeps_outputs(baseline: Run, offloaded: Offloaded) -> None:
    # 48 offloaded blocks of 64 tokens (2 of vLLM's blocks each) against
    # 50 stored by the workload before A comes back: A's tail goes first
    run = offloaded(num_cpu_blocks=48, block_size=64, eviction_policy="lru")
    assert run.outputs() == baseline.outputs()
    step = run.steps["a_again"]
    assert run.stats.counters.evictions["lru"] > 0
    assert 0 < step.cached_tokens < PREFIX_TOKENS
    assert step.cached_tokens % 64 == 0
    assert step.load_blocks == step.hit_blocks == step.cached_tokens // 64
    assert step.transferred("load") == step.cached_tokens // GPU_BLOCK_SIZE
    assert run.stats.used <= 48


def test_engine_gpu_hit_ending_inside_an_offloaded_block_defect7(
    model_dir: Path, baseline: Run
) -> None:
    """vLLM keeps 17 of A's 32-token blocks, the tier holds 64-token blocks:
    the load starts in the middle of offloaded block 8 (its first half is
    on the GPU already), which vLLM 0.11.2's own handler asserts on."""
    run = run_workload(
        model_dir,
        kvoffload_extra(num_cpu_blocks=BIG_TIER, block_size=64),
        workload=midblock_prompts,
    )
    step = run.steps["a_again"]
    assert step.cached_tokens == PREFIX_TOKENS  # 17 blocks from vLLM's cache, 3 loaded
    assert step.load_blocks == 2  # offloaded blocks 8 and 9 ...
    assert step.transferred("load") == 3  # ... of which 3 GPU blocks, not 4
    assert step.output == run.steps["a"].output == baseline.steps["a"].output


def test_vllm_own_handler_asserts_on_that_load_defect7() -> None:
    """The load above (2 offloaded blocks of 2 sub-blocks into 3 GPU blocks)
    given to vLLM 0.11.2's own handler: it checks the counts before touching
    CUDA, so this runs without a GPU (its constructor would not; skipped)."""
    from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
    from vllm.v1.kv_offload.worker.cpu_gpu import CpuGpuOffloadingHandler

    handler = object.__new__(CpuGpuOffloadingHandler)
    handler.block_size_factor = 2
    handler.h2d_stream = None  # read before the check, used only after it
    handler.cpu_tensors = handler.gpu_tensors = []
    with pytest.raises(AssertionError):
        handler.transfer_async(1, (CPULoadStoreSpec([8, 9]), GPULoadStoreSpec([17, 18, 19])))


def test_engine_zeroed_loads_change_outputs(model_dir: Path, baseline: Run) -> None:
    """The comparison above can fail: overwrite what the tier loads with
    zeros before vLLM computes with it, and A's output is no longer A's."""
    run = run_workload(
        model_dir,
        kvoffload_extra(num_cpu_blocks=BIG_TIER, eviction_policy="lru"),
        zero_loaded_kv=True,
    )
    assert run.steps["a_again"].cached_tokens == PREFIX_TOKENS  # loaded, then zeroed
    assert run.steps["a_again"].output != baseline.steps["a_again"].output
    assert run.steps["a"].output == baseline.steps["a"].output  # before any load


def test_engine_bad_extra_config_fails_engine_start_naming_choices(model_dir: Path) -> None:
    extra = kvoffload_extra(num_cpu_blocks=0, block_size=48, eviction_policy="mru")
    with failing_engine_start(), pytest.raises(ConfigError) as info:
        make_llm(model_dir, extra)
    message = str(info.value)
    assert "num_cpu_blocks must be a positive integer, got 0" in message
    assert "block_size 48 is not a positive multiple of vLLM's block size 32" in message
    assert f"(registered policies: {', '.join(available_policies())})" in message


def test_engine_row_kernel_reaches_the_handler(model_dir: Path) -> None:
    # true asks every copy of the CUDA row kernel: on vLLM's CPU platform the
    # handler refuses it at the worker's start, naming what it needs
    with failing_engine_start(), pytest.raises(ConfigError, match="row_kernel=True needs KV"):
        make_llm(model_dir, kvoffload_extra(num_cpu_blocks=8, row_kernel=True))


def test_engine_cpu_offloading_spec_name_gets_vllm_own_spec_which_refuses_cpu(
    model_dir: Path,
) -> None:
    """Why the spec has its own name: vLLM looks ``CPUOffloadingSpec`` up in
    its registry before spec_module_path, and its spec refuses this platform."""
    extra = {
        "spec_name": "CPUOffloadingSpec",
        "spec_module_path": "kvoffload.spec",
        "num_cpu_blocks": 8,
    }
    with (
        failing_engine_start(),
        pytest.raises(Exception, match="only supported on CUDA-alike GPUs"),
    ):
        make_llm(model_dir, extra)


def script_process(
    model_dir: Path, extra: dict[str, Any], result: Path, engine: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """The workload in a fresh process whose engine core runs in a child
    process of its own (vLLM's default outside tests), writing ``result``."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    script = Path(__file__).with_name("workload.py")
    args = [sys.executable, str(script), str(model_dir), json.dumps(extra), str(result)]
    if engine is not None:
        args.append(json.dumps(engine))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=420)


def run_script(
    model_dir: Path, extra: dict[str, Any], tmp_path: Path, engine: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """:func:`script_process`, which must succeed: what it wrote, and its log."""
    result = tmp_path / "steps.json"
    out = script_process(model_dir, extra, result, engine)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(result.read_text()), out.stdout + out.stderr


def test_a_bad_extra_config_in_the_engine_core_s_own_process(
    model_dir: Path, tmp_path: Path
) -> None:
    """docs/vllm.md: with the engine core in a process of its own, the caller
    gets vLLM's RuntimeError and the ConfigError is in the engine core's log."""
    out = script_process(model_dir, kvoffload_extra(num_cpu_blocks=0), tmp_path / "none.json")
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "RuntimeError: Engine core initialization failed" in log, log[-3000:]
    assert "num_cpu_blocks must be a positive integer, got 0" in log, log[-3000:]


def test_engine_core_in_its_own_process(model_dir: Path, baseline: Run, tmp_path: Path) -> None:
    """With vLLM's engine core in a child process (its default outside
    tests) the spec is loaded there and the tier serves the prefix; the
    admin server runs there too, with the worker's transfers, logs where it
    listens and is reached from the parent process, which has none."""
    port = free_port()
    extra = kvoffload_extra(num_cpu_blocks=BIG_TIER, eviction_policy="kvarc", admin_port=port)
    answer, log = run_script(model_dir, extra, tmp_path)
    steps = answer["steps"]
    assert {n: tuple(s["output"]) for n, s in steps.items()} == baseline.outputs()
    assert steps["a_again"]["cached_tokens"] == PREFIX_TOKENS
    admin = answer["admin"]
    assert admin["servers_here"] == 0  # the front-end process runs none
    assert admin["cache"]["policy"] == "kvarc"
    assert admin["cache"]["counters"]["load_blocks"] == PREFIX_TOKENS // GPU_BLOCK_SIZE
    assert 'kvoffload_transfer_jobs_total{direction="load",outcome="ok"} 1.0' in admin["metrics"]
    assert re.search(
        rf"\(EngineCore\S* pid=\d+\)\S* INFO .* kvoffload admin API of this vLLM engine at "
        rf"http://127\.0\.0\.1:{port} \(admin_port {port} ",
        log,
    ), log[-3000:]


def test_two_tensor_parallel_workers(model_dir: Path, tmp_path: Path) -> None:
    """With two tensor-parallel worker processes each builds its own
    handler and CPU mirror over its shard of the KV cache, and both copy
    the prefix back: A's second run, its 640-token prefix from the tier,
    gives the output its first run computed. The engine core's admin server
    has the manager's side (the hits and loads) and no worker: its transfer
    series are there, at 0."""
    port = free_port()
    extra = kvoffload_extra(num_cpu_blocks=BIG_TIER, eviction_policy="kvarc", admin_port=port)
    engine = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    answer, log = run_script(model_dir, extra, tmp_path, engine)
    steps = answer["steps"]
    assert steps["a_again"]["cached_tokens"] == steps["b"]["cached_tokens"] == PREFIX_TOKENS
    assert steps["a_again"]["output"] == steps["a"]["output"]
    # one mirror per worker: the engine core builds none, so the two come
    # from the two workers (their "(Worker_TPn pid=...)" prefixes cannot be
    # matched to the lines: two processes writing to one pipe interleave them)
    assert log.count("CPU mirror: ") == 2, log[-3000:]
    assert re.search(r"\(EngineCore\S* pid=\d+\)\S* INFO .* workers in this process: 0", log)
    assert {"Worker_TP0", "Worker_TP1"} <= set(re.findall(r"\((Worker_TP\d)\S* pid=\d+\)", log))
    counters = answer["admin"]["cache"]["counters"]
    loaded = PREFIX_TOKENS // GPU_BLOCK_SIZE  # A's prefix, once (B finds it on the GPU)
    assert counters["hit_blocks"] == counters["load_blocks"] == loaded
    metrics = answer["admin"]["metrics"]
    assert f"kvoffload_load_blocks_total {loaded}.0" in metrics
    for direction in ("load", "store"):
        assert (
            f'kvoffload_transfer_jobs_total{{direction="{direction}",outcome="ok"}} 0.0' in metrics
        )


def test_engine_serves_a_policy_of_ones_own_through_policy_modules(
    model_dir: Path, baseline: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/writing-a-policy.md's FIFO example, named in the extra config
    with the module that registers it: the spec imports it, and the tier
    serves the prefix with the same outputs."""
    import kvoffload.policies as policies

    guide = Path(__file__).resolve().parents[2] / "docs" / "writing-a-policy.md"
    example = re.search(
        r"## A complete example: FIFO\n.*?```python\n(.*?)```", guide.read_text(), re.S
    )
    assert example is not None
    (tmp_path / "guide_fifo_policy.py").write_text(example.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))
    extra = kvoffload_extra(
        num_cpu_blocks=BIG_TIER, eviction_policy="fifo", policy_modules=["guide_fifo_policy"]
    )
    run = run_workload(model_dir, extra)
    assert run.stats.policy == "fifo"
    assert run.outputs() == baseline.outputs()
    assert run.steps["a_again"].cached_tokens == PREFIX_TOKENS
