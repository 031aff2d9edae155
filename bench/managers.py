"""Manager throughput and memory, against a bare ``OrderedDict`` LRU loop.

Replays the Mooncake traces in data/traces the way an engine's
scheduler drives a manager, per request::

    touch(hashes); n = lookup(hashes); out = prepare_store(hashes[n:])
    if out: complete_store(out.block_hashes_to_store)

and prints, per trace and capacity (1/5/10/25% of the trace's unique blocks):

* block operations per second (hashes passed to touch + lookup +
  prepare_store + complete_store) of every registered policy, next to a bare
  ``OrderedDict`` LRU loop doing the same accesses with the same prefix
  semantics in the same process (best of 3, runs interleaved), and each
  one's prefix hit ratio (the bare loop's must equal LRU's: checked);
* a pinned-heavy case: the first half of the trace warms the cache, half of
  the resident blocks are then pinned by loads that stay in flight, and the
  second half is replayed; ops/s relative to the same replay without pins;
* a pinned-idle case: the whole trace in a cache of ``c`` blocks, and in
  one of ``2c`` whose other half is pinned by blocks the trace never asks
  for; both see the same hits and stores (checked for LRU), so the ratio is
  what skipping pinned blocks costs, with no change of workload mix;
* the manager's own memory per resident block with 500,000 blocks resident
  (tracemalloc; the hash keys are created before tracing starts), and for
  ARC also with both ghost lists full.

Times are the process's CPU time (``time.process_time``), so other load on
the machine does not count; the garbage collector stays on (it is part of
the manager's cost), collected before every run. In the pinned-heavy table
``st/op`` is stored blocks per block op: pins lower the hit ratio, so more of
the ops are stores, which cost more than lookups.

Targets (issue 2): LRU and ARC >= 0.8x the bare loop; pinned-heavy (and
pinned-idle) no slower per op than plain; <= 150 bytes per resident block
(vLLM's managers: ~227).

    .venv/bin/python bench/managers.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ref import VERSION, VLLMUnavailable, load_vllm

from kvoffload import BlockHash, CPUBackend, PolicyOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.policies.arc import ARCPolicy

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
PERCENTS = (1, 5, 10, 25)
BLOCK_SIZE = 16

Request = list[BlockHash]


@dataclass(frozen=True)
class Run:
    """One timed replay."""

    seconds: float
    lookup_blocks: int
    hit_blocks: int
    stored_blocks: int

    @property
    def block_ops(self) -> int:
        # touch + lookup see every hash, prepare_store the ones past the hit
        # prefix, complete_store the ones it allocated
        return 3 * self.lookup_blocks - self.hit_blocks + self.stored_blocks

    @property
    def ops_per_s(self) -> float:
        return self.block_ops / self.seconds

    @property
    def store_share(self) -> float:
        """Stored blocks per block op: stores cost more than lookups, so a
        run with fewer hits does fewer ops per second for that reason alone."""
        return self.stored_blocks / self.block_ops

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


def load_trace(path: Path, limit: int | None) -> tuple[list[Request], int]:
    """The trace's requests as lists of ``bytes`` hashes (one object per id,
    made once, outside any timed region) and its number of unique blocks."""
    keys: dict[int, BlockHash] = {}
    requests: list[Request] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            ids = json.loads(line)["hash_ids"]
            requests.append(
                [keys.get(x) or keys.setdefault(x, BlockHash(x.to_bytes(8, "little"))) for x in ids]
            )
    return requests, len(keys)


# -- the two replays ----------------------------------------------------------


def replay_manager(m: Any, requests: Sequence[Request]) -> Run:
    """The replay on any manager with vLLM's API (kvoffload's or vLLM's
    own), counting from the answers as the bare loop does."""
    touch, lookup = m.touch, m.lookup
    prepare_store, complete_store = m.prepare_store, m.complete_store
    lookup_blocks = hit_blocks = stored = 0
    t0 = time.process_time()
    for hashes in requests:
        touch(hashes)
        n = lookup(hashes)
        out = prepare_store(hashes[n:])
        if out:
            complete_store(out.block_hashes_to_store)
            stored += len(out.block_hashes_to_store)
        lookup_blocks += len(hashes)
        hit_blocks += n
    return Run(time.process_time() - t0, lookup_blocks, hit_blocks, stored)


def replay_bare(requests: Sequence[Request], capacity: int) -> Run:
    """The same protocol on one ``OrderedDict`` (hash -> ready), LRU first:
    touch in reverse, prefix lookup of ready blocks, store the absent ones
    evicting the oldest blocks not named in the call (all or nothing), then
    mark them ready."""
    od: OrderedDict[BlockHash, bool] = OrderedDict()
    move, get = od.move_to_end, od.get
    lookup_blocks = hit_blocks = stored = 0
    t0 = time.process_time()
    for hashes in requests:
        for h in reversed(hashes):
            if h in od:
                move(h)
        n = 0
        for h in hashes:
            if not get(h):
                break
            n += 1
        lookup_blocks += len(hashes)
        hit_blocks += n
        named = dict.fromkeys(hashes[n:])
        new = [h for h in named if h not in od]
        need = len(new) - (capacity - len(od))
        if need > 0:
            victims = []
            for h in od:
                if h not in named:
                    victims.append(h)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                continue
            for h in victims:
                del od[h]
        for h in new:
            od[h] = False
        for h in new:
            od[h] = True
        stored += len(new)
    return Run(time.process_time() - t0, lookup_blocks, hit_blocks, stored)


def _timed(replay: Callable[..., Run], *args: object) -> Run:
    """One replay from a freshly collected heap (the garbage of the previous
    run is not charged to this one)."""
    gc.collect()
    return replay(*args)


def new_manager(policy: str, capacity: int) -> PolicyOffloadingManager:
    return PolicyOffloadingManager(CPUBackend(BLOCK_SIZE, capacity), policy=policy)


# -- the three tables ---------------------------------------------------------


def fmt_ops(x: float) -> str:
    return f"{x / 1e6:.2f}M"


def throughput(name: str, requests: list[Request], unique: int, repeats: int) -> list[str]:
    rows = []
    policies = available_policies()
    for pct in PERCENTS:
        capacity = max(1, unique * pct // 100)
        best: dict[str, Run] = {}
        for _ in range(repeats):  # interleaved, best of `repeats`
            for p in (*policies, "bare"):
                if p == "bare":
                    run = _timed(replay_bare, requests, capacity)
                else:
                    run = _timed(replay_manager, new_manager(p, capacity), requests)
                if p not in best or run.seconds < best[p].seconds:
                    best[p] = run
        bare = best["bare"]
        if "lru" in best:
            lru = best["lru"]
            assert (lru.hit_blocks, lru.stored_blocks) == (bare.hit_blocks, bare.stored_blocks), (
                f"bare loop and LRU disagree on {name} at {pct}%: "
                f"hits {bare.hit_blocks} vs {lru.hit_blocks}"
            )
        for p in policies:
            r = best[p]
            rows.append(
                f"{name:<13}{pct:>4}%{capacity:>8} {p:<7}{fmt_ops(r.ops_per_s):>9}"
                f"{fmt_ops(bare.ops_per_s):>10}{r.ops_per_s / bare.ops_per_s:>7.2f}"
                f"{r.hit_ratio:>8.3f}{bare.hit_ratio:>9.3f}"
            )
    return rows


def phases(name: str, requests: list[Request], unique: int, repeats: int) -> list[str]:
    """Where a request's time goes: microseconds per request in each verb
    (best of ``repeats``; the clock calls themselves add ~0.1 us a verb),
    and the bare loop's whole request for scale."""
    rows = []
    for pct in (5, 25):
        capacity = max(1, unique * pct // 100)
        bare = min(_timed(replay_bare, requests, capacity).seconds for _ in range(repeats))
        for p in available_policies():
            best = [float("inf")] * 4
            for _ in range(repeats):
                gc.collect()
                spent = _replay_phases(new_manager(p, capacity), requests)
                best = [min(b, t) for b, t in zip(best, spent, strict=True)]
            per_req = [1e6 * t / len(requests) for t in best]
            rows.append(
                f"{name:<13}{pct:>4}%{capacity:>8} {p:<7}"
                + "".join(f"{t:>9.2f}" for t in per_req)
                + f"{sum(per_req):>9.2f}{1e6 * bare / len(requests):>9.2f}"
            )
    return rows


def _replay_phases(m: PolicyOffloadingManager, requests: Sequence[Request]) -> list[float]:
    clock = time.perf_counter
    touch = lookup = prepare = complete = 0.0
    for hashes in requests:
        t0 = clock()
        m.touch(hashes)
        t1 = clock()
        n = m.lookup(hashes)
        t2 = clock()
        out = m.prepare_store(hashes[n:])
        t3 = clock()
        if out:
            m.complete_store(out.block_hashes_to_store)
        t4 = clock()
        touch += t1 - t0
        lookup += t2 - t1
        prepare += t3 - t2
        complete += t4 - t3
    return [touch, lookup, prepare, complete]


def pinned_heavy(name: str, requests: list[Request], unique: int, repeats: int) -> list[str]:
    rows = []
    half = len(requests) // 2
    warm, rest = requests[:half], requests[half:]
    for pct in PERCENTS:
        capacity = max(1, unique * pct // 100)
        for p in available_policies():
            best: dict[bool, Run] = {}
            n_pinned = 0
            for _ in range(repeats):
                for pinned in (False, True):
                    m = new_manager(p, capacity)
                    replay_manager(m, warm)
                    if pinned:
                        resident = [h for h, _ in m.policy.ordered_items() if m.table.ref(h) == 0]
                        chosen = random.Random(pct).sample(resident, len(resident) // 2)
                        m.prepare_load(chosen)  # loads left in flight: pinned throughout
                        n_pinned = len(chosen)
                    run = _timed(replay_manager, m, rest)
                    if pinned not in best or run.seconds < best[pinned].seconds:
                        best[pinned] = run
            plain, pin = best[False], best[True]
            rows.append(
                f"{name:<13}{pct:>4}%{capacity:>8} {p:<7}{n_pinned:>8}"
                f"{fmt_ops(plain.ops_per_s):>9}{fmt_ops(pin.ops_per_s):>9}"
                f"{pin.ops_per_s / plain.ops_per_s:>7.2f}"
                f"{plain.hit_ratio:>8.3f}{pin.hit_ratio:>8.3f}"
                f"{plain.store_share:>8.3f}{pin.store_share:>8.3f}"
            )
    return rows


def pinned_idle(name: str, requests: list[Request], unique: int, repeats: int) -> list[str]:
    """The cost of pinned blocks alone: the same replay in a cache of ``c``
    blocks, and in a cache of ``2c`` whose other half is pinned by blocks the
    trace never asks for. Both see the same hits, stores and evictions, so
    the ratio isolates what the pinned blocks cost. A third run, ``padded``,
    puts ``c`` ghost entries the policies never use in a cache of ``c``: a
    table as large as the pinned run's, with nothing pinned. ``pin/pad``
    near 1 says the pinned run's cost is the size of the table (memory
    traffic), not skipping pinned blocks."""
    rows = []
    for pct in PERCENTS:
        capacity = max(1, unique * pct // 100)
        idle = [BlockHash(b"idle" + i.to_bytes(8, "little")) for i in range(capacity)]
        for p in available_policies():
            best: dict[str, Run] = {}
            for _ in range(repeats):
                for case in ("plain", "pinned", "padded"):
                    m = new_manager(p, 2 * capacity if case == "pinned" else capacity)
                    if case == "pinned":
                        _fill(m, idle)
                        m.prepare_load(idle)  # pinned for the whole replay
                    elif case == "padded":
                        _ghosts(m, idle)
                    run = _timed(replay_manager, m, requests)
                    if case not in best or run.seconds < best[case].seconds:
                        best[case] = run
            plain, pin, pad = best["plain"], best["pinned"], best["padded"]
            if p == "lru":  # pins change nothing else; ARC's bounds scale with the capacity
                assert (plain.hit_blocks, plain.stored_blocks) == (
                    pin.hit_blocks,
                    pin.stored_blocks,
                ), f"pinned idle blocks changed LRU's hits on {name} at {pct}%"
            rows.append(
                f"{name:<13}{pct:>4}%{capacity:>8} {p:<7}{capacity:>8}"
                f"{fmt_ops(plain.ops_per_s):>9}{fmt_ops(pin.ops_per_s):>9}"
                f"{pin.ops_per_s / plain.ops_per_s:>7.2f}"
                f"{fmt_ops(pad.ops_per_s):>9}{pin.ops_per_s / pad.ops_per_s:>8.2f}"
                f"{plain.hit_ratio:>8.3f}{pin.hit_ratio:>8.3f}"
            )
    return rows


def _ghosts(m: PolicyOffloadingManager, keys: Sequence[BlockHash]) -> None:
    """``keys`` as ghosts of a ghost list no policy uses (tag 7): entries in
    the table that no verb ever meets."""
    unused_list, unused_ghosts = 3, 7
    table, n = m.table, len(keys)
    table.insert(keys, list(range(n)), unused_list)
    table.complete(keys)
    assert table.evict(unused_list, n, (), ghost_a=unused_ghosts) is not None
    assert len(table) == 0 and table.size(unused_ghosts) == n


def _fill(m: Any, keys: Sequence[BlockHash], chunk: int = 1000) -> None:
    for i in range(0, len(keys), chunk):
        out = m.prepare_store(keys[i : i + chunk])
        assert out is not None
        m.complete_store(out.block_hashes_to_store)


def against_vllm(vllm: Any) -> Callable[[str, list[Request], int, int], list[str]]:
    """The throughput table against vLLM's own LRU and ARC managers."""

    def table(name: str, requests: list[Request], unique: int, repeats: int) -> list[str]:
        rows = []
        for pct in PERCENTS:
            capacity = max(1, unique * pct // 100)
            for p, cls in (("lru", "LRUOffloadingManager"), ("arc", "ARCOffloadingManager")):
                best: dict[str, Run] = {}
                for _ in range(repeats):
                    for side in ("ours", "vllm"):
                        if side == "ours":
                            m = new_manager(p, capacity)
                        else:
                            m = getattr(vllm, cls)(vllm.CPUBackend(BLOCK_SIZE, capacity))
                        run = _timed(replay_manager, m, requests)
                        if side not in best or run.seconds < best[side].seconds:
                            best[side] = run
                ours, theirs = best["ours"], best["vllm"]
                rows.append(
                    f"{name:<13}{pct:>4}%{capacity:>8} {p:<7}"
                    f"{fmt_ops(ours.ops_per_s):>9}{fmt_ops(theirs.ops_per_s):>9}"
                    f"{ours.ops_per_s / theirs.ops_per_s:>7.2f}"
                    f"{ours.hit_ratio:>8.3f}{theirs.hit_ratio:>9.3f}"
                )
        return rows

    return table


def vllm_memory(vllm: Any, resident: int) -> list[str]:
    """vLLM's managers' bytes per resident block, measured like ours."""
    keys = [BlockHash(i.to_bytes(8, "little")) for i in range(resident)]
    rows = []
    for p, cls in (("lru", "LRUOffloadingManager"), ("arc", "ARCOffloadingManager")):
        gc.collect()
        tracemalloc.start()
        m = getattr(vllm, cls)(vllm.CPUBackend(BLOCK_SIZE, resident))
        _fill(m, keys)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rows.append(f"{'vllm ' + p:<28}{resident:>9}{used / resident:>10.1f}")
        del m
    return rows


def memory(resident: int) -> list[str]:
    # Every hash object exists before tracing starts, so it is not counted:
    # the keys belong to the caller (the engine hashes the tokens anyway).
    keys = [BlockHash(i.to_bytes(8, "little")) for i in range(3 * resident)]
    rows = []
    cases: list[tuple[str, str]] = [(p, "") for p in available_policies()]
    if "arc" in available_policies():
        cases.append(("arc", "ghosts"))
    for policy, variant in cases:
        gc.collect()
        tracemalloc.start()
        m = new_manager(policy, resident)
        if variant == "ghosts":
            # every block promoted to T2; a second fill with a large target
            # evicts all of T2 into B2; a third with target 0 evicts the
            # second fill from T1 into B1: B1 = B2 = capacity
            arc = m.policy
            assert isinstance(arc, ARCPolicy)
            _fill(m, keys[:resident])
            m.touch(keys[:resident])
            arc.target_t1_size = resident
            _fill(m, keys[resident : 2 * resident])
            arc.target_t1_size = 0
            _fill(m, keys[2 * resident :])
        else:
            _fill(m, keys[:resident])
        gc.collect()
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        lists = ", ".join(f"{k}={v}" for k, v in m.stats().lists.items())
        label = policy + (" + full ghost lists" if variant else "")
        rows.append(f"{label:<28}{resident:>9}{used / resident:>10.1f}   {lists}")
        del m
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short traces, one run each")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also compare with vLLM 0.11.2's own managers (its wheel: scripts/fetch-vllm)",
    )
    args = parser.parse_args()
    vllm = None
    if args.vllm:
        try:
            vllm = load_vllm()
        except VLLMUnavailable as e:
            print(f"--vllm: {e}", file=sys.stderr)
            return 1
    limit = 1500 if args.quick else None
    repeats = 1 if args.quick else 3
    traces = sorted(TRACES.glob("*.jsonl"))
    if not traces:
        print(f"no traces in {TRACES}", file=sys.stderr)
        return 1
    loaded = []
    for path in traces:
        requests, unique = load_trace(path, limit)
        name = path.stem.removeprefix("mooncake_").removesuffix("_trace")
        loaded.append((name, requests, unique))
        print(
            f"# {name}: {len(requests)} requests, {unique} unique blocks, "
            f"{sum(map(len, requests))} block accesses"
        )

    columns = f"{'trace':<13}{'cap':>5}{'blocks':>8} {'policy':<7}"
    tables: list[tuple[str, str, Callable[[str, list[Request], int, int], list[str]]]] = [
        (
            f"throughput: block ops/s (best of {repeats}); bare = OrderedDict LRU loop",
            f"{'ops/s':>9}{'bare':>10}{'ratio':>7}{'hit':>8}{'bare hit':>9}",
            throughput,
        ),
        (
            "phases: us per request in each verb; bare = the bare loop's whole request",
            f"{'touch':>9}{'lookup':>9}{'prepare':>9}{'complete':>9}{'total':>9}{'bare':>9}",
            phases,
        ),
        (
            "pinned-heavy: half the resident blocks pinned by loads in flight",
            f"{'pinned':>8}{'plain':>9}{'pinned':>9}{'ratio':>7}{'hit':>8}{'hit pin':>8}"
            f"{'st/op':>8}{'st/op p':>8}",
            pinned_heavy,
        ),
        (
            "pinned-idle: as many blocks again, pinned, that the trace never uses",
            f"{'pinned':>8}{'plain':>9}{'pinned':>9}{'ratio':>7}{'padded':>9}{'pin/pad':>8}"
            f"{'hit':>8}{'hit pin':>8}",
            pinned_idle,
        ),
    ]
    if vllm is not None:
        tables.append(
            (
                f"vllm: block ops/s against vLLM {VERSION}'s own managers ({vllm.source})",
                f"{'ours':>9}{'vllm':>9}{'ratio':>7}{'hit':>8}{'vllm hit':>9}",
                against_vllm(vllm),
            )
        )
    for title, header, table in tables:
        print(f"\n== {title}")
        print(columns + header)
        for name, requests, unique in loaded:
            for row in table(name, requests, unique, repeats):
                print(row, flush=True)

    resident = 50_000 if args.quick else 500_000
    print("\n== memory: the manager's own bytes per resident block (tracemalloc)")
    print(f"{'policy':<28}{'resident':>9}{'B/block':>10}   lists")
    for row in memory(resident):
        print(row, flush=True)
    if vllm is not None:
        for row in vllm_memory(vllm, resident):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
