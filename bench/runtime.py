"""End-to-end replay throughput of the serving runtime under each eviction policy.

Replays the Mooncake conversation trace through :class:`Engine` (GPU KV
store, offloading manager, CPU<->GPU handler, byte-for-byte verification of
every load) with a CPU tier of 10% of the trace's unique blocks. One
offloaded block per trace id: ``gpu_block_size=128``,
``offloaded_block_size=512`` (the trace's block size). Each policy gets a
fresh engine; the wall time of ``Engine.run()`` is measured, nothing is
asserted except that no loaded block failed verification (exit status 1
otherwise).

Columns: requests/s, engine steps/s, GPU-sized blocks moved/s and bytes
moved/s (loads + stores), the prefix hit ratios achieved (CPU tier:
``cpu_hit_tokens`` over the prompt tokens served, ``prompt_tokens -
truncated_tokens``; GPU prefix cache likewise) and ``verify_failures``.

Torch runs single-threaded unless ``--threads`` says otherwise: the
engine's tensor ops are small (one request's blocks), and on a loaded
machine torch's intra-op thread pool made them 30-100x slower.

Run: ``.venv/bin/python bench/runtime.py [--quick] [--limit N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvoffload.policies import available_policies
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.snapshot import EngineSnapshot
from kvoffload.runtime.trace import TraceWorkload, load_mooncake_trace
from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler

TRACE = (
    Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_conversation_trace.jsonl"
)
GPU_BLOCK = 128
CPU_BLOCK = 512
GIB = 2**30
MIB = 2**20
#: requests replayed by default: about a minute for both policies on 2 cores
DEFAULT_LIMIT = 6000
QUICK_LIMIT = 800


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    seconds: float
    snap: EngineSnapshot

    def row(self) -> dict[str, float | int | str]:
        rt = self.snap.runtime
        s = self.seconds
        moved_blocks = rt.loaded_gpu_blocks + rt.stored_gpu_blocks
        moved_bytes = rt.loaded_bytes + rt.stored_bytes
        prompt = max(1, rt.prompt_tokens - rt.truncated_tokens)  # the tokens served
        return {
            "policy": self.policy,
            "seconds": round(s, 3),
            "requests": rt.requests,
            "steps": rt.steps,
            "requests_per_s": rt.requests / s,
            "steps_per_s": rt.steps / s,
            "blocks_moved_per_s": moved_blocks / s,
            "bytes_moved_per_s": moved_bytes / s,
            "loaded_gpu_blocks": rt.loaded_gpu_blocks,
            "stored_gpu_blocks": rt.stored_gpu_blocks,
            "cpu_hit_ratio": rt.cpu_hit_tokens / prompt,
            "gpu_hit_ratio": rt.gpu_hit_tokens / prompt,
            "evictions": sum(self.snap.manager.counters.evictions.values()),
            "failed_jobs": rt.failed_jobs,
            "verify_failures": rt.verify_failures,
        }


def make_config(args: argparse.Namespace, policy: str, capacity: int) -> EngineConfig:
    return EngineConfig(
        policy=policy,
        num_cpu_blocks=capacity,
        num_gpu_blocks=args.gpu_blocks,
        gpu_block_size=GPU_BLOCK,
        offloaded_block_size=CPU_BLOCK,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        kv_layout=args.layout,
        device=args.device,
        max_requests_per_step=args.batch,
    )


def replay(config: EngineConfig, trace: TraceWorkload) -> Result:
    engine = Engine(config, trace)
    t0 = time.perf_counter()
    snap = engine.run()
    seconds = time.perf_counter() - t0
    if engine.kv.device.type == "cuda":
        torch.cuda.synchronize()
    return Result(config.policy, seconds, snap)


def mirror_bytes(config: EngineConfig) -> int:
    """Bytes of the CPU mirror, computed without allocating it."""
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    shape = (2, config.num_gpu_blocks, GPU_BLOCK, config.num_kv_heads, config.head_size)
    caches = {
        f"layer.{i}": torch.empty(shape, dtype=dtype[config.dtype], device="meta")
        for i in range(config.num_layers)
    }
    return CpuGpuOffloadingHandler.mirror_bytes(
        caches, GPU_BLOCK, CPU_BLOCK, config.num_cpu_blocks, layouts="kv_first"
    )


def print_table(rows: list[dict[str, float | int | str]]) -> None:
    head = (
        f"{'policy':<7}{'seconds':>9}{'req/s':>9}{'steps/s':>9}{'blocks/s':>11}"
        f"{'MiB/s':>9}{'loaded':>9}{'stored':>9}{'cpu hit':>9}{'gpu hit':>9}"
        f"{'evicted':>9}{'verify fail':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['policy']:<7}{r['seconds']:>9.2f}{r['requests_per_s']:>9.1f}"
            f"{r['steps_per_s']:>9.1f}{r['blocks_moved_per_s']:>11.0f}"
            f"{float(r['bytes_moved_per_s']) / MIB:>9.1f}{r['loaded_gpu_blocks']:>9}"
            f"{r['stored_gpu_blocks']:>9}{r['cpu_hit_ratio']:>9.3f}{r['gpu_hit_ratio']:>9.3f}"
            f"{r['evictions']:>9}{r['verify_failures']:>12}"
        )
    if len(rows) == 2:
        a, b = rows
        print(
            f"\n{b['policy']}/{a['policy']}: throughput "
            f"{float(b['requests_per_s']) / float(a['requests_per_s']):.2f}x, "
            f"CPU hit ratio {float(b['cpu_hit_ratio']) / max(float(a['cpu_hit_ratio']), 1e-9):.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="Mooncake JSONL trace")
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"replay the first N requests (default {DEFAULT_LIMIT}, --quick {QUICK_LIMIT})",
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK_LIMIT} requests")
    p.add_argument(
        "--policies",
        default=",".join(available_policies()),
        help="comma-separated policy names (default: every registered policy)",
    )
    p.add_argument(
        "--capacity", type=float, default=0.10, help="CPU tier as a fraction of unique blocks"
    )
    p.add_argument("--gpu-blocks", type=int, default=512, help="GPU KV cache blocks")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-size", type=int, default=16)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--layout", default="kv_first", choices=("kv_first", "blocks_first"))
    p.add_argument("--batch", type=int, default=4, help="requests per engine step")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (0 = torch's default); 1 by default because the engine's "
        "tensor ops are small and torch's intra-op threads make them 30-100x slower on a busy "
        "machine",
    )
    p.add_argument("--max-mirror-gib", type=float, default=2.0, help="refuse a bigger CPU mirror")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    limit = args.limit or (QUICK_LIMIT if args.quick else DEFAULT_LIMIT)

    trace = load_mooncake_trace(args.trace, trace_block_size=CPU_BLOCK, limit=limit)
    unique = trace.unique_blocks
    capacity = max(1, round(unique * args.capacity))
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    probe = make_config(args, policies[0], capacity)
    mirror = mirror_bytes(probe)
    if mirror > args.max_mirror_gib * GIB:
        print(
            f"the CPU mirror would take {mirror / GIB:.2f} GiB (> {args.max_mirror_gib} GiB): "
            "use fewer layers, heads or a smaller head size, or raise --max-mirror-gib",
            file=sys.stderr,
        )
        return 2
    gpu_block_bytes = mirror // (capacity * probe.block_factor)
    if not args.json:
        print(trace.describe())
        print(
            f"CPU tier {capacity} blocks of {CPU_BLOCK} tokens ({args.capacity:.0%} of {unique} "
            f"unique), mirror {mirror / GIB:.2f} GiB; GPU cache {args.gpu_blocks} blocks of "
            f"{GPU_BLOCK} tokens, {gpu_block_bytes / 1024:.0f} KiB each "
            f"({args.layers} layers x {args.kv_heads} KV heads x {args.head_size}, {args.dtype}, "
            f"{args.layout}); {args.batch} requests per step; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads\n",
            flush=True,
        )

    rows = []
    for policy in policies:
        result = replay(make_config(args, policy, capacity), trace)
        rows.append(result.row())
        if not args.json:
            print(f"  {policy}: {result.seconds:.1f} s", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print()
        print_table(rows)
    return 1 if any(r["verify_failures"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
