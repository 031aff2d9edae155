"""Compare eviction policies by offline replay: LRU, ARC, kvarc and Belady.

Prints, per workload and capacity (1/5/10/25% of unique blocks), the prefix
hit ratio of each policy, Belady's bound, and each policy's block ops/s as a
ratio of LRU's. Workloads: the two Mooncake traces in data/traces
and three built-in synthetic shapes, other seeds.

    .venv/bin/python bench/policies.py [--only NAME,...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

from kvoffload.replay import ReplayTrace, belady, replay
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.trace import load_mooncake_trace
from kvoffload.runtime.workloads import Request

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
CAPACITIES = (1, 5, 10, 25)
POLICIES = ("lru", "arc", "kvarc")
SYNTHETIC = {
    "gen-default-s1": SyntheticConfig(seed=1),
    "gen-scan-heavy-s2": SyntheticConfig(
        seed=2,
        open_chats=1024,
        chat_weight=0.4,
        document_weight=0.2,
        one_off_weight=0.4,
        num_documents=5000,
    ),
    "gen-long-chats-s3": SyntheticConfig(
        seed=3,
        chat_weight=0.7,
        document_weight=0.2,
        one_off_weight=0.1,
        mean_turns=10.0,
        turn_blocks=(2, 8),
        zipf_exponent=1.1,
    ),
}


def _workloads(only: set[str] | None) -> Iterable[tuple[str, Iterable[Request]]]:
    for name in ("conversation", "synthetic"):
        path = TRACES / f"mooncake_{name}_trace.jsonl"
        if only is None or name in only:
            yield name, load_mooncake_trace(path)
    for name, cfg in SYNTHETIC.items():
        if only is None or name in only:
            yield name, SyntheticWorkload(cfg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated workload names")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    head = f"{'workload':<20}{'cap':>5}" + "".join(f"{p:>9}" for p in POLICIES)
    head += f"{'belady':>9}" + "".join(f"{p + ' ops':>10}" for p in POLICIES[1:])
    print(head)
    for name, workload in _workloads(only):
        trace = ReplayTrace.from_requests(workload, name=name, trace_block_size=512)
        unique = trace.unique_blocks
        for pct in CAPACITIES:
            cap = max(1, unique * pct // 100)
            res = {p: replay(trace, policy=p, capacity=cap) for p in POLICIES}
            bound = belady(trace.block_hashes, cap).prefix_hit_ratio
            lru_ops = res["lru"].block_ops_per_second
            line = f"{name:<20}{pct:>4}%" + "".join(
                f"{res[p].prefix_hit_ratio:>9.4f}" for p in POLICIES
            )
            line += f"{bound:>9.4f}" + "".join(
                f"{res[p].block_ops_per_second / lru_ops:>9.2f}x" for p in POLICIES[1:]
            )
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
