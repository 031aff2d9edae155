"""Transfer bandwidth of CpuGpuOffloadingHandler against a plain contiguous copy.

For each per-layer block size and job size it times a store (GPU->CPU) and a
load (CPU->GPU) job through the handler, with contiguous and with random block
ids, and a plain contiguous ``Tensor.copy_`` of the same bytes between the
same devices in the same direction (``out``: device to mirror, ``in``: mirror
to device; one copy per layer, like the job). Ratios near 1 mean the block
mapping costs nothing on top of moving the bytes. On CUDA a runner keeps up to
:data:`IN_FLIGHT` jobs in flight, as an engine does, and each timed batch ends
with a device sync for both; docs/transfer.md has an H200's figures.

On CUDA ``--path`` chooses how scattered mirror rows are copied: ``auto`` (the
handler's default), ``engines`` (copy engines only, ``row_kernel=False``) or
``kernel`` (the row kernel for every job, ``row_kernel=True``).

Run: ``.venv/bin/python bench/transfer.py [--quick] [--threads N] [--device cpu|cuda]
[--path auto|engines|kernel] [--block-kib 16,64] [--blocks 64,256]``, or
``--plan`` to time only the planning of a job, hot and right after a copy (where
it runs in a handler), with the C planner against the numpy one.
Timings are best-of-batches; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvoffload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import block_map
from kvoffload.transfer.block_map import plan_transfer
from kvoffload.transfer.cpu_gpu import CpuGpuOffloadingHandler
from kvoffload.transfer.worker import TransferSpec

KIB = 1024
MIB = 1024 * KIB
#: --path -> CpuGpuOffloadingHandler(row_kernel=...)
PATHS = {"auto": None, "engines": False, "kernel": True}
#: Jobs a runner leaves in flight before it waits (CUDA; CPU jobs finish at submit).
IN_FLIGHT = 4


def best_seconds(
    fns: dict[str, Callable[[], None]],
    sync: Callable[[], None],
    budget_s: float,
    clock: Callable[[], float],
    rounds: int = 5,
) -> dict[str, float]:
    """Best per-call time of each function. Rounds interleave the functions so
    that drift in machine load hits them all alike."""
    reps: dict[str, int] = {}
    for name, fn in fns.items():
        fn()
        sync()
        t0 = clock()
        fn()
        sync()
        once = max(clock() - t0, 1e-6)
        reps[name] = max(1, int(budget_s / rounds / len(fns) / once))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(reps[name]):
                fn()
            sync()
            best[name] = min(best[name], (clock() - t0) / reps[name])
    return best


def job_runner(
    handler: CpuGpuOffloadingHandler, spec: TransferSpec, job_ids: Iterator[int]
) -> Callable[[], None]:
    """A call that submits ``spec`` as a new job and reaps the jobs finished
    so far, keeping at most :data:`IN_FLIGHT` in flight, as an engine does
    (it submits each step and polls the next); the batch's closing sync
    waits for the copies, like the reference's."""

    def run() -> None:
        ok = handler.transfer_async(next(job_ids), spec)
        assert ok, "the benchmark submitted a malformed job"
        while True:
            assert all(ok for _, ok in handler.get_finished()), "a job failed"
            if handler.num_in_flight <= IN_FLIGHT:
                return

    return run


def plain_copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> Callable[[], None]:
    """The reference: one contiguous ``copy_`` per layer of the same bytes."""

    def run() -> None:
        for s, d in zip(srcs, dsts, strict=True):
            d.copy_(s, non_blocking=True)

    return run


def bench_block_size(
    block_bytes: int,
    counts: list[int],
    args: argparse.Namespace,
    rng: np.random.Generator,
    sync: Callable[[], None],
    clock: Callable[[], float],
    budget: float,
    ratios: dict[str, list[float]],
) -> None:
    """Print one table row per (job size, id pattern) for one block size."""
    f = args.factor
    n_max = max(counts)
    # Random ids come from a pool of up to 4x the largest job so they
    # scatter, capped near 512 MiB per layer to bound memory.
    pool = max(n_max, min(4 * n_max, (512 * MIB) // block_bytes))
    pool -= pool % f
    device = torch.device(args.device)
    caches = {
        f"layer{i}": torch.randn((pool, block_bytes // 2), device=device).to(torch.float16)
        for i in range(args.layers)
    }
    handler = CpuGpuOffloadingHandler(
        16, 16 * f, pool // f, caches, max_cpu_bytes=None, row_kernel=PATHS[args.path]
    )
    job_ids = itertools.count()
    for n in counts:
        if n % f:
            continue
        for pattern in ("contiguous", "random"):
            if pattern == "contiguous":
                gpu_ids, cpu_ids = np.arange(n), np.arange(n // f)
            else:
                gpu_ids = rng.choice(pool, n, replace=False)
                cpu_ids = rng.choice(pool // f, n // f, replace=False)
            store: TransferSpec = (GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(cpu_ids))
            load: TransferSpec = (CPULoadStoreSpec(cpu_ids), GPULoadStoreSpec(gpu_ids))
            elems = n * block_bytes // 2
            dev = [c.view(-1)[:elems] for c in caches.values()]
            mirror = [m.view(-1)[:elems] for m in handler.cpu_tensors]
            t = best_seconds(
                {
                    "store": job_runner(handler, store, job_ids),
                    "load": job_runner(handler, load, job_ids),
                    "out": plain_copy(dev, mirror),
                    "in": plain_copy(mirror, dev),
                },
                sync,
                budget,
                clock,
            )
            nbytes = n * block_bytes * args.layers
            st, ld = t["out"] / t["store"], t["in"] / t["load"]
            if n >= 64:
                ratios[pattern] += [st, ld]
            gbs = "".join(f" {nbytes / t[k] / 1e9:>8.2f}" for k in ("store", "load", "out", "in"))
            print(
                f"{block_bytes // KIB:>6}Ki {n:>6} {pattern[:6]:>6}{gbs} {st:>8.2f} {ld:>8.2f}",
                flush=True,
            )


def bench_plan(layers: int, rng: np.random.Generator) -> None:
    """Planning one job (``plan_transfer``, 64 random 16 KiB blocks) in a hot
    loop and right after a plain copy of the job's bytes has flushed the
    caches, with the C planner and with the numpy one it falls back to."""
    n, block_bytes = 64, 16 * KIB
    spec: TransferSpec = (
        GPULoadStoreSpec(rng.choice(4 * n, n, replace=False)),
        CPULoadStoreSpec(rng.choice(4 * n, n, replace=False)),
    )
    src = torch.ones(layers * n * block_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def median_us(after_copy: bool, reps: int = 2000) -> float:
        times = []
        for _ in range(reps):
            if after_copy:
                dst.copy_(src)
            t0 = time.perf_counter_ns()
            plan_transfer(spec, 1, num_gpu_blocks=4 * n, num_cpu_blocks=4 * n)
            times.append(time.perf_counter_ns() - t0)
        return statistics.median(times) / 1e3

    saved = block_map._rows
    us: dict[str, tuple[float, float]] = {}
    try:
        for name, rows in (("c", saved), ("numpy", None)):
            if name == "c" and rows is None:
                print("plan: no C planner (not built, or KVOFFLOAD_PURE_PYTHON is set)")
                continue
            block_map._rows = rows
            us[name] = (median_us(False), median_us(True))
    finally:
        block_map._rows = saved
    mib = layers * n * block_bytes / MIB
    for name, (hot, cold) in us.items():
        print(
            f"plan {name:>5}: {hot:6.1f} us hot, {cold:6.1f} us after a {mib:g} MiB copy "
            f"(cold/hot {cold / hot:.2f})"
        )
    if len(us) == 2:
        print(f"plan numpy/c after a copy: {us['numpy'][1] / us['c'][1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--path",
        choices=list(PATHS),
        default="auto",
        help="CUDA: how scattered mirror rows are copied (handler's row_kernel)",
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--factor", type=int, default=1, help="cpu_block_size / gpu_block_size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--block-kib",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="comma-separated block sizes in KiB per layer (default: by --quick)",
    )
    ap.add_argument(
        "--blocks",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="comma-separated job sizes in blocks (default: by --quick)",
    )
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu = this thread's CPU time: steadier on a shared machine; "
        "only meaningful on --device cpu with --threads 1",
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="only time planning a 64-block job, hot and after a copy, C against numpy",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.path != "auto" and not args.device.startswith("cuda"):
        ap.error("--path engines|kernel chooses between CUDA copy paths: it needs --device cuda")
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        ap.error("--clock cpu needs --device cpu and --threads 1")
    if args.plan:
        bench_plan(args.layers, np.random.default_rng(args.seed))
        return
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    sync: Callable[[], None] = (
        torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    )
    block_sizes = (
        [16 * KIB, 256 * KIB, 2 * MIB]
        if args.quick
        else [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
    )
    if args.block_kib:
        block_sizes = [k * KIB for k in args.block_kib]
    counts = [1, 16, 64, 256] if args.quick else [1, 4, 16, 64, 128, 256]
    if args.blocks:
        counts = args.blocks
    budget = 0.1 if args.quick else 0.5
    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"layers={args.layers} factor={args.factor} clock={args.clock} path={args.path} "
        "(GB/s = 1e9 bytes/s over all layers; st/out = store GB/s / out GB/s, "
        "ld/in = load GB/s / in GB/s)"
    )
    header = (
        f"{'block':>8} {'blocks':>6} {'ids':>6} {'store':>8} {'load':>8} {'out':>8} "
        f"{'in':>8} {'st/out':>8} {'ld/in':>8}"
    )
    print(header)
    print("-" * len(header))
    ratios: dict[str, list[float]] = {"contiguous": [], "random": []}
    rng = np.random.default_rng(args.seed)
    for block_bytes in block_sizes:
        bench_block_size(block_bytes, counts, args, rng, sync, clock, budget, ratios)
    print()
    for pattern, rs in ratios.items():
        if rs:
            print(
                f"jobs >= 64 blocks, {pattern} ids: ratio to contiguous copy "
                f"min {min(rs):.2f}, median {statistics.median(rs):.2f}, max {max(rs):.2f}"
            )


if __name__ == "__main__":
    main()
