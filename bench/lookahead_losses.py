"""Where hkvarc's hits go with a window (issue 19): what is left against Belady.

For one cell (workload, capacity, W) it replays a policy (hkvarc by default)
with the next W requests hinted, as ``kvoffload replay --lookahead W`` does,
and prints:

* the blocks Belady hits and the policy does not, request by request, by
  why the first block the policy missed was absent: evicted while no
  waiting request used it (from T1 or T2: its ghost list says which),
  evicted while held (a waiting request used it), declined by the store
  that would have kept it, or never stored;
* the same against the issue's baseline (window-Belady with LRU fallback,
  replayed with the same window), and the blocks the policy hits and the
  baseline does not;
* the victims evicted unhinted: how many are used again, within which
  distance (in requests), and the share used again by the list they left;
* evicted held blocks, declined blocks, and the hinted resident blocks
  (what hkvarc holds) on average and at most.

``docs/policies.md`` quotes its figures for the cells hkvarc is short in.

    .venv/bin/python bench/lookahead_losses.py WORKLOAD CAP W [POLICY]
    .venv/bin/python bench/lookahead_losses.py conversation 5% 2048
"""

from __future__ import annotations

import bisect
import sys
from collections import Counter, defaultdict, deque
from collections.abc import Sequence

from lookahead import BASELINE, CAPACITIES, GENERATED, SHARED, load, register_baseline

from kvoffload import BlockHash, CPUBackend, PolicyOffloadingManager
from kvoffload.policies import available_policies
from kvoffload.policies.arc import B1, B2
from kvoffload.replay import ReplayTrace, belady, parse_capacity, replay

#: next-use distances (requests) the unhinted victims are counted in
DISTANCES = (128, 512, 2048, 8192)
#: the list a victim left, by the ghost list it joined
LEFT = {B1: "T1", B2: "T2"}


def distance_bucket(d: int | None) -> str:
    if d is None:
        return "never"
    for bound in DISTANCES:
        if d <= bound:
            return f"<= {bound}"
    return f"> {DISTANCES[-1]}"


def losses(trace: ReplayTrace, capacity: int, w: int, policy: str) -> None:
    requests = trace.block_hashes
    bound = belady(requests, capacity)
    base = replay(trace, policy=BASELINE, capacity=capacity, lookahead=w).request_hits
    uses: dict[BlockHash, list[int]] = defaultdict(list)  # the requests using each block
    for i, r in enumerate(requests):
        for h in dict.fromkeys(r):
            uses[h].append(i)

    def next_use(h: BlockHash, i: int) -> int | None:
        later = uses[h]
        q = bisect.bisect_right(later, i)
        return later[q] if q < len(later) else None

    m = PolicyOffloadingManager(CPUBackend(16, capacity), policy=policy)
    table = m.table
    why: dict[BlockHash, str] = {}  # why a block is absent, as of its last change
    lost: Counter[str] = Counter()
    lost_to_base: Counter[str] = Counter()
    ahead_of_base = 0
    unhinted: Counter[str] = Counter()  # unhinted victims by list
    reused: Counter[str] = Counter()  # ... of those, used again
    distance: Counter[str] = Counter()
    held_victims = declined = hits = held_sum = held_max = 0
    window = deque(m.hint(r) for r in requests[:w])
    for i, hashes in enumerate(requests):
        req = list(hashes)
        if w:
            if i + w < len(requests):
                window.append(m.hint(requests[i + w]))
            held_sum += table.window_resident
            held_max = max(held_max, table.window_resident)
            m.unhint(window.popleft())
        m.touch(req)
        k = m.lookup(req)
        hits += k
        if bound.request_hits[i] > k:
            lost[why.get(req[k], "never stored")] += bound.request_hits[i] - k
        if base[i] > k:
            lost_to_base[why.get(req[k], "never stored")] += base[i] - k
        else:
            ahead_of_base += k - base[i]
        absent = [h for h in req[k:] if h not in table]
        out = m.prepare_store(req[k:])
        if out is None:
            continue
        kept = set(out.block_hashes_to_store)
        for h in absent:
            if h not in kept:
                declined += 1
                why[h] = "declined"
        victims = out.block_hashes_evicted
        for h, use, tag in zip(victims, table.next_uses(victims), table.tags(victims), strict=True):
            if use >= 0:
                held_victims += 1
                why[h] = "evicted held"
                continue
            lst = LEFT.get(tag, "?")
            why[h] = f"evicted unhinted from {lst}"
            unhinted[lst] += 1
            nxt = next_use(h, i)
            reused[lst] += nxt is not None
            distance[distance_bucket(None if nxt is None else nxt - i)] += 1
        m.complete_store(out.block_hashes_to_store)
    accesses = sum(map(len, requests))
    print(f"{policy}: prefix hit ratio {hits / accesses:.4f}, Belady {bound.prefix_hit_ratio:.4f}")
    print(f"blocks Belady hits and {policy} does not: {sum(lost.values())}")
    for reason, n in lost.most_common():
        print(f"  {reason:<26}{n:>9}")
    print(
        f"against the baseline ({sum(base) / accesses:.4f}): blocks it hits and {policy} does "
        f"not: {sum(lost_to_base.values())}; the other way round: {ahead_of_base}"
    )
    for reason, n in lost_to_base.most_common():
        print(f"  {reason:<26}{n:>9}")
    total = sum(unhinted.values())
    print(f"victims evicted unhinted: {total}; used again, by list:")
    for lst, n in sorted(unhinted.items()):
        print(f"  {lst}: {reused[lst]} of {n} ({reused[lst] / n:.1%})")
    print("  next use after eviction, in requests:")
    for b in [*(f"<= {d}" for d in DISTANCES), f"> {DISTANCES[-1]}", "never"]:
        print(f"    {b:<10}{distance[b]:>9}")
    print(f"held victims: {held_victims}; declined blocks: {declined}")
    if w:
        print(
            f"hinted resident blocks: {held_sum / len(requests):.0f} on average, "
            f"{held_max} at most, of {capacity}"
        )


def main(argv: Sequence[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__.strip().splitlines()[-2].strip())
        return 2
    name, cap, w_text = argv[:3]
    policy = argv[3] if len(argv) == 4 else "hkvarc"
    register_baseline()
    if name not in (*SHARED, *GENERATED) or cap not in CAPACITIES or not w_text.isdigit():
        print(
            f"want WORKLOAD CAP W [POLICY]: workloads {[*SHARED, *GENERATED]}, caps "
            f"{list(CAPACITIES)}, W an integer >= 0"
        )
        return 2
    if policy not in available_policies():
        print(f"unknown policy {policy!r}; valid: {sorted(available_policies())}")
        return 2
    trace = load(name)
    capacity = parse_capacity(cap, trace.unique_blocks)
    print(f"{name} {cap} ({capacity} blocks), W={w_text}")
    losses(trace, capacity, int(w_text), policy)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
