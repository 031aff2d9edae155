"""What HostedManager's lock costs per call: the same replay through a bare
PolicyOffloadingManager and through a HostedManager around one, as a ratio.

Per request of a Mooncake trace, the calls a scheduler makes (touch, lookup,
prepare_load + complete_load of the hit, prepare_store + complete_store of the
rest), on a CPU tier of 10% of the trace's unique blocks. Runs alternate
(ABBA) and the headline is the median of per-pair ratios of calls per second,
so a machine busy with something else skews both sides alike.

    .venv/bin/python bench/hosted.py [--quick] [--policy arc]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvoffload import CPUBackend, OffloadingManager, PolicyOffloadingManager  # noqa: E402
from kvoffload.abstract import BlockHash  # noqa: E402
from kvoffload.replay import ReplayTrace  # noqa: E402
from kvoffload.runtime import HostedManager  # noqa: E402
from kvoffload.runtime.trace import load_mooncake_trace  # noqa: E402

TRACE = ROOT / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def replay(manager: OffloadingManager, chains: tuple[tuple[BlockHash, ...], ...]) -> int:
    """Drive ``manager`` through ``chains``; the number of calls made."""
    calls = 0
    for chain in chains:
        hashes = list(chain)
        manager.touch(hashes)
        hit = manager.lookup(hashes)
        calls += 2
        if hit:
            manager.prepare_load(hashes[:hit])
            manager.complete_load(hashes[:hit])
            calls += 2
        out = manager.prepare_store(hashes[hit:])
        calls += 1
        if out is not None:
            manager.complete_store(out.block_hashes_to_store)
            calls += 1
    return calls


def calls_per_second(
    hosted: bool, chains: tuple[tuple[BlockHash, ...], ...], policy: str, capacity: int
) -> float:
    bare = PolicyOffloadingManager(CPUBackend(block_size=16, num_blocks=capacity), policy=policy)
    manager: OffloadingManager = HostedManager(bare) if hosted else bare
    t0 = time.perf_counter()
    calls = replay(manager, chains)
    return calls / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--pairs", type=int, default=5, help="ABBA pairs of runs")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--quick", action="store_true", help="2 pairs of 2000 requests")
    args = parser.parse_args(argv)
    pairs, limit = (2, 2000) if args.quick else (args.pairs, args.limit)
    trace = ReplayTrace.from_requests(
        load_mooncake_trace(str(TRACE), trace_block_size=512, limit=limit),
        name=TRACE.name,
        trace_block_size=512,
    )
    capacity = max(1, trace.unique_blocks // 10)
    ratios, bare_rates, hosted_rates = [], [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        rates = {h: calls_per_second(h, trace.block_hashes, args.policy, capacity) for h in order}
        bare_rates.append(rates[False])
        hosted_rates.append(rates[True])
        ratios.append(rates[True] / rates[False])
    print(f"trace {trace.name}: {len(trace.block_hashes)} requests, capacity {capacity} blocks")
    print(f"{'manager':<10} {'policy':<7} {'calls/s':>12} {'ratio':>7}")
    print(f"{'bare':<10} {args.policy:<7} {statistics.median(bare_rates):>12,.0f} {1.0:>6.2f}x")
    print(
        f"{'hosted':<10} {args.policy:<7} {statistics.median(hosted_rates):>12,.0f} "
        f"{statistics.median(ratios):>6.2f}x"
    )
    per_call_ns = 1e9 / statistics.median(hosted_rates) - 1e9 / statistics.median(bare_rates)
    print(
        f"hosted/bare calls per second (median of {pairs} ABBA pairs): "
        f"{statistics.median(ratios):.3f}; about {per_call_ns:.0f} ns more per call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
