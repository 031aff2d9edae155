"""Lookahead: what hints from the waiting queue buy (issue 19), and what they cost.

Grid: every workload at 5% and 10% of its unique blocks, with the next W
requests hinted while one is served (``kvoffload replay --lookahead W``,
W in 0, 8, 32, 128, 512, 2048), prefix hit ratio of

* ``kvarc`` (it ignores hints: the same at every W),
* ``baseline``: the issue's "window-Belady with LRU fallback" (evict the
  least recently used block no window request uses, else the window block
  used farthest ahead; W = 0 is LRU). A reference for this bench only,
  :class:`WindowBeladyLRU` below; it is not one of kvoffload's policies,
* ``hkvarc``,
* Belady (the whole future known, every store admitted: hkvarc, which may
  decline stores, can beat it by a hair; ``belady(..., bypass=True)`` is
  the bound for a policy that declines, docs/policies.md),

with the share of the LRU-to-Belady gap hkvarc closes (the baseline's in
brackets). On the shared traces each cell is checked against the issue's
targets (its published baseline figures, the cells it lists, kvarc - 0.005,
exactly kvarc at W = 0); on the generator's workloads against the baseline
measured here. Workloads: the two shared traces, the four generator
workloads the scratch prototype fixed before any result (``gen-*-s11..s14``)
and two more fixed for this bench before its first run (``s21``, ``s22``).

Speed: block ops/s (hashes passed to touch + lookup + prepare_store +
complete_store; process CPU time, best of ``--repeats``, runs interleaved in
an order that rotates by one each round, garbage collected before each) of
hkvarc at W = 128 against LRU with no hints, the issue's target being 0.7x;
also against LRU driven with the same hints (which it ignores), and with the
hinted hashes counted as block ops.

``--seed-offset N`` replays the generator workloads with their seeds moved
by N (the same shapes, other requests), to validate a change beyond the
fixed seeds; ``bench/lookahead_losses.py`` says, for one cell, what is left
against Belady.

    .venv/bin/python bench/lookahead.py [--quick] [--only NAME,...] [--no-grid] [--no-speed]
        [--seed-offset N]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload import BlockHash, CPUBackend, PolicyOffloadingManager
from kvoffload.backend import Handle
from kvoffload.policies import available_policies, register_policy
from kvoffload.policies.base import Victims
from kvoffload.policies.lru import LRU, LRUPolicy
from kvoffload.replay import ReplayTrace, belady, parse_capacity, replay
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.trace import load_mooncake_trace

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
WS = (0, 8, 32, 128, 512, 2048)
CAPACITIES = ("5%", "10%")
SHARED = ("conversation", "synthetic")
GENERATED = {
    # fixed by the scratch prototype before any result of the policy
    "gen-default-s11": SyntheticConfig(seed=11),
    "gen-rag-s12": SyntheticConfig(
        seed=12,
        chat_weight=0.15,
        document_weight=0.7,
        one_off_weight=0.15,
        num_documents=4000,
        document_blocks=(8, 48),
        zipf_exponent=1.1,
    ),
    "gen-agentic-s13": SyntheticConfig(
        seed=13,
        chat_weight=0.8,
        document_weight=0.1,
        one_off_weight=0.1,
        open_chats=1024,
        mean_turns=12.0,
        turn_blocks=(1, 8),
    ),
    "gen-scan-s14": SyntheticConfig(
        seed=14,
        chat_weight=0.3,
        document_weight=0.2,
        one_off_weight=0.5,
        one_off_blocks=(8, 64),
        open_chats=128,
    ),
    # fixed for this bench before its first run
    "gen-longchat-s21": SyntheticConfig(
        seed=21,
        chat_weight=0.6,
        document_weight=0.25,
        one_off_weight=0.15,
        open_chats=512,
        mean_turns=8.0,
        turn_blocks=(2, 6),
    ),
    "gen-hotdocs-s22": SyntheticConfig(
        seed=22,
        chat_weight=0.3,
        document_weight=0.6,
        one_off_weight=0.1,
        num_documents=500,
        document_blocks=(16, 64),
        zipf_exponent=1.2,
    ),
}

#: the issue's table of the baseline (prefix hit ratio, 4 places), by W
ISSUE_BASELINE = {
    ("conversation", "5%"): (0.1957, 0.1973, 0.2061, 0.2257, 0.2755, 0.3519),
    ("conversation", "10%"): (0.2787, 0.2797, 0.2829, 0.2903, 0.3154, 0.3542),
    ("synthetic", "5%"): (0.1551, 0.1680, 0.1913, 0.2707, 0.3807, 0.3903),
    ("synthetic", "10%"): (0.2604, 0.2676, 0.2821, 0.3435, 0.4721, 0.5057),
}
#: the cells the issue lists: at least this
LISTED = {
    ("conversation", "5%", 128): 0.2307,
    ("conversation", "10%", 128): 0.2953,
    ("conversation", "5%", 512): 0.2805,
    ("conversation", "10%", 512): 0.3204,
    ("synthetic", "5%", 128): 0.2757,
    ("synthetic", "10%", 128): 0.3485,
}
#: hkvarc may trail kvarc by at most this at any W
KVARC_SLACK = 0.005
#: read literally, the issue also asks this much over the baseline wherever
#: the baseline is more than ``BELOW_BELADY`` below Belady (W > 0); it lists
#: only the cells above (``LISTED``), so the bench reports the rest apart
MARGIN, BELOW_BELADY = 0.005, 0.01
#: the issue's figures are rounded to 4 places
ROUNDING = 0.00005

BASELINE = "window-belady-lru"


class WindowBeladyLRU(LRUPolicy):
    """The issue's baseline, for comparison only: LRU over the blocks no
    waiting request uses; blocks a waiting request uses are held (the
    table's hint order) and evicted only when no other is left, farthest
    next use first."""

    name = BASELINE

    def seed(self, items: Sequence[tuple[BlockHash, Handle]]) -> None:
        super().seed(items)
        self.table.set_hint_order(True)

    def evict(self, n: int, protected: Container[BlockHash]) -> Victims | None:
        picked = self.table.evict(LRU, n, protected, spill=True)
        return None if picked is None else (picked[0], picked[1])


def register_baseline() -> None:
    """Make the baseline selectable by name in this process (the grid does;
    importing this module does not, so it leaves the registry alone)."""
    if BASELINE not in available_policies():
        register_policy(BASELINE, f"{__name__}:WindowBeladyLRU")


def load(name: str, limit: int | None = None, seed_offset: int = 0) -> ReplayTrace:
    """A workload of the grid; ``seed_offset`` moves a generator workload's
    seed (the same shape, other requests: validation beyond the fixed seeds)."""
    if name in SHARED:
        workload = load_mooncake_trace(TRACES / f"mooncake_{name}_trace.jsonl", limit=limit)
        return ReplayTrace.from_requests(
            workload, name=name, trace_block_size=workload.trace_block_size
        )
    cfg = dataclasses.replace(GENERATED[name], seed=GENERATED[name].seed + seed_offset)
    if limit is not None:
        cfg = dataclasses.replace(cfg, num_requests=limit)
    return ReplayTrace.from_requests(
        SyntheticWorkload(cfg), name=name, trace_block_size=cfg.trace_block_size
    )


# -- the grid ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    workload: str
    capacity: str
    lookahead: int
    baseline: float
    kvarc: float
    hkvarc: float
    lru: float
    belady: float
    #: the issue's published baseline figure (shared traces), else the one measured
    published: float
    #: hits of hkvarc and kvarc (exactness at W = 0)
    hits: tuple[int, int]

    def gap(self, ratio: float) -> float:
        return (ratio - self.lru) / (self.belady - self.lru) if self.belady > self.lru else 0.0

    def checks(self) -> list[tuple[str, bool, bool]]:
        """(what, passed, a target the issue lists) of every check this cell has."""
        out = [
            (f">= baseline {self.published:.4f}", self.hkvarc >= self.published - ROUNDING, True)
        ]
        if self.lookahead == 0:
            out.append(("= kvarc", self.hits[0] == self.hits[1], True))
        else:
            out.append((f">= kvarc-{KVARC_SLACK}", self.hkvarc >= self.kvarc - KVARC_SLACK, True))
        listed = LISTED.get((self.workload, self.capacity, self.lookahead))
        if listed is not None:
            out.append((f">= {listed:.4f} (listed)", self.hkvarc >= listed - ROUNDING, True))
        elif self.lookahead and self.belady - self.published > BELOW_BELADY:
            want = self.published + MARGIN
            out.append((f">= {want:.4f} (literal)", self.hkvarc >= want - ROUNDING, False))
        return out


def grid(name: str, trace: ReplayTrace, ws: Sequence[int], *, whole: bool = True) -> list[Cell]:
    """The cells of one workload; ``whole``: the trace is not cut short, so
    the issue's published figures apply."""
    register_baseline()
    cells = []
    for spec in CAPACITIES:
        capacity = parse_capacity(spec, trace.unique_blocks)
        lru = replay(trace, policy="lru", capacity=capacity).prefix_hit_ratio
        kvarc = replay(trace, policy="kvarc", capacity=capacity)
        bound = belady(trace.block_hashes, capacity).prefix_hit_ratio
        for w in ws:
            base = replay(trace, policy=BASELINE, capacity=capacity, lookahead=w)
            ours = replay(trace, policy="hkvarc", capacity=capacity, lookahead=w)
            published = ISSUE_BASELINE.get((name, spec)) if whole else None
            cells.append(
                Cell(
                    workload=name,
                    capacity=spec,
                    lookahead=w,
                    baseline=base.prefix_hit_ratio,
                    kvarc=kvarc.prefix_hit_ratio,
                    hkvarc=ours.prefix_hit_ratio,
                    lru=lru,
                    belady=bound,
                    published=(
                        published[WS.index(w)] if published and w in WS else base.prefix_hit_ratio
                    ),
                    hits=(ours.hit_blocks, kvarc.hit_blocks),
                )
            )
    return cells


def print_grid(cells: Sequence[Cell]) -> tuple[int, int]:
    """The cells as a table; returns how many targets failed, and how many
    literal-reading checks."""
    print(
        "| workload | cap | W | baseline | kvarc | hkvarc | Belady | gap closed | "
        "hkvarc - baseline | targets |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = literal = 0
    for c in cells:
        checks = c.checks()
        failed += sum(not ok for _, ok, hard in checks if hard)
        literal += sum(not ok for _, ok, hard in checks if not hard)
        verdict = ", ".join(
            ("pass " if ok else "FAIL " if hard else "short ") + what for what, ok, hard in checks
        )
        print(
            f"| {c.workload} | {c.capacity} | {c.lookahead} | {c.baseline:.4f} | {c.kvarc:.4f} | "
            f"{c.hkvarc:.4f} | {c.belady:.4f} | {c.gap(c.hkvarc):.0%} ({c.gap(c.baseline):.0%}) | "
            f"{c.hkvarc - c.published:+.4f} | {verdict} |",
            flush=True,
        )
    return failed, literal


# -- speed --------------------------------------------------------------------------


@dataclass(frozen=True)
class Speed:
    seconds: float
    block_ops: int
    hinted: int

    @property
    def ops_per_s(self) -> float:
        return self.block_ops / self.seconds

    @property
    def ops_and_hints_per_s(self) -> float:
        return (self.block_ops + self.hinted) / self.seconds


def timed(policy: str, capacity: int, requests: Sequence[list[BlockHash]], w: int) -> Speed:
    """The replay's protocol with a window of ``w``, timed as a whole."""
    m = PolicyOffloadingManager(CPUBackend(16, capacity), policy=policy)
    touch, lookup, prepare_store, complete_store = (
        m.touch,
        m.lookup,
        m.prepare_store,
        m.complete_store,
    )
    hint, unhint = m.hint, m.unhint
    n_requests = len(requests)
    ops = hinted = 0
    gc.collect()
    t0 = time.process_time()
    window = deque(hint(r) for r in requests[:w])
    for i, hashes in enumerate(requests):
        if w:
            if i + w < n_requests:
                window.append(hint(requests[i + w]))
            unhint(window.popleft())
        touch(hashes)
        hit = lookup(hashes)
        out = prepare_store(hashes[hit:])
        ops += 3 * len(hashes) - hit
        if out is not None:
            complete_store(out.block_hashes_to_store)
            ops += len(out.block_hashes_to_store)
    seconds = time.process_time() - t0
    if w:
        hinted = sum(map(len, requests))
    return Speed(seconds, ops, hinted)


SPEED_RUNS = (("lru", 0), ("lru", 128), ("kvarc", 0), ("hkvarc", 128))


def speed(name: str, trace: ReplayTrace, repeats: int) -> list[str]:
    requests = [list(h) for h in trace.block_hashes]
    rows = []
    for spec in CAPACITIES:
        capacity = parse_capacity(spec, trace.unique_blocks)
        best: dict[tuple[str, int], Speed] = {}
        for k in range(repeats):
            # each round starts one run later: no run always comes first or last
            turn = k % len(SPEED_RUNS)
            for policy, w in SPEED_RUNS[turn:] + SPEED_RUNS[:turn]:
                s = timed(policy, capacity, requests, w)
                if (policy, w) not in best or s.seconds < best[policy, w].seconds:
                    best[policy, w] = s
        lru, lru_hinted = best["lru", 0].ops_per_s, best["lru", 128].ops_per_s
        ours = best["hkvarc", 128]
        rows.append(
            f"{name:<14}{spec:>5}{lru / 1e6:>9.2f}M{best['kvarc', 0].ops_per_s / lru:>9.2f}x"
            f"{ours.ops_per_s / lru:>11.2f}x{ours.ops_per_s / lru_hinted:>12.2f}x"
            f"{ours.ops_and_hints_per_s / lru:>13.2f}x"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short workloads, few W, one run")
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--no-grid", action="store_true", help="skip the hit-ratio grid")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed table")
    parser.add_argument("--repeats", type=int, default=8, help="speed: best of this many runs")
    parser.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="add this to every generator workload's seed (validation on other requests)",
    )
    args = parser.parse_args()
    names = [*SHARED, *GENERATED]
    if args.only:
        names = [n for n in args.only.split(",") if n]
        unknown = set(names) - {*SHARED, *GENERATED}
        if unknown:
            print(f"unknown workloads: {sorted(unknown)}; known: {[*SHARED, *GENERATED]}")
            return 2
    limit = 1500 if args.quick else None
    ws = (0, 32) if args.quick else WS
    traces = {name: load(name, limit, args.seed_offset) for name in names}
    if not args.no_grid:
        print("== grid: prefix hit ratio with the next W requests hinted\n")
        cells = [
            c for name, trace in traces.items() for c in grid(name, trace, ws, whole=limit is None)
        ]
        failed, literal = print_grid(cells)
        print(f"\ntargets failed: {failed}; short of the literal +{MARGIN} reading: {literal}")
    if not args.no_speed:
        print(
            "\n== speed: block ops/s (best of "
            f"{1 if args.quick else args.repeats}); hkvarc at W=128 against"
        )
        print(
            f"{'workload':<14}{'cap':>5}{'LRU':>10}{'kvarc':>10}{'vs LRU':>12}"
            f"{'vs LRU@128':>12}{'hints as ops':>13}"
        )
        for name in (n for n in names if n in SHARED):
            for row in speed(name, traces[name], 1 if args.quick else args.repeats):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
