"""The block table alone: ns per hash, C and pure Python, against ``OrderedDict``.

A table of ``--size`` resident blocks (8-byte ``bytes`` hashes, ``int``
handles) and calls of ``--batch`` hashes, as a manager makes them per
request. Three verbs, each timed over many calls:

* ``touch``: half of the hashes resident, half never seen (a new prompt's
  tail), visited last to first; the reference moves the resident ones to
  the recent end of an ``OrderedDict``;
* ``lookup``: a prefix of resident, ready hashes; the reference tests
  membership until the first miss;
* ``store``: evict the ``batch`` oldest blocks, insert ``batch`` new ones
  (in flight) and complete their stores; the reference pops the oldest
  entries and inserts the new ones twice (in flight, then ready), as
  ``bench/managers.py``'s bare loop does.

Prints ns per hash (process CPU time, best of ``--repeats``, the three
implementations interleaved in one process) and each one's ratio to the
``OrderedDict`` reference (< 1: faster than it).

    .venv/bin/python bench/table.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvoffload.table import PyBlockTable

try:
    from kvoffload._table import BlockTable as CBlockTable
except ImportError:  # reported in the output
    CBlockTable = None

Verb = Callable[[], int]  # runs the verb over every call; returns hashes handled


def _keys(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(8, "little") for i in range(start, start + n)]


class Workload:
    """The calls every implementation gets: the same hashes, made once."""

    def __init__(self, size: int, batch: int, calls: int, repeats: int) -> None:
        rng = random.Random(1)
        self.size, self.batch, self.calls = size, batch, calls
        self.resident = _keys(0, size)
        fresh = iter(_keys(size, calls * batch * (repeats + 1)))
        half = batch // 2
        self.touches = [
            rng.sample(self.resident, half) + [next(fresh) for _ in range(batch - half)]
            for _ in range(calls)
        ]
        self.prefixes = [rng.sample(self.resident, batch) for _ in range(calls)]
        #: one list of store calls per run: every run stores hashes never seen
        self.stores = [
            [[next(fresh) for _ in range(batch)] for _ in range(calls)] for _ in range(repeats)
        ]


def table_verbs(make: Callable[[], Any], w: Workload) -> dict[str, Verb]:
    """The three verbs on a block table (C or Python). ``store`` runs on a
    table of its own, so the others always see the same resident blocks."""
    batch = w.batch
    tables = [make(), make()]
    for t in tables:
        t.insert(w.resident, list(range(w.size)), 0)
        t.complete(w.resident)
    table, churn = tables
    stores = iter(w.stores)
    handles = list(range(batch))

    def touch() -> int:
        for hashes in w.touches:
            table.touch(hashes)
        return w.calls * batch

    def lookup() -> int:
        for hashes in w.prefixes:
            table.lookup(hashes)
        return w.calls * batch

    def store() -> int:
        for hashes in next(stores):
            churn.evict(0, batch, ())
            churn.insert(hashes, handles, 0)
            churn.complete(hashes)
        return w.calls * batch

    return {"touch": touch, "lookup": lookup, "store": store}


def reference_verbs(w: Workload) -> dict[str, Verb]:
    """The same verbs on ``OrderedDict`` s (hash -> ready), LRU first."""
    batch = w.batch
    od: OrderedDict[bytes, bool] = OrderedDict(dict.fromkeys(w.resident, True))
    churn = od.copy()
    stores = iter(w.stores)
    move, pop = od.move_to_end, churn.popitem

    def touch() -> int:
        for hashes in w.touches:
            for h in reversed(hashes):
                if h in od:
                    move(h)
        return w.calls * batch

    def lookup() -> int:
        for hashes in w.prefixes:
            for h in hashes:
                if not od.get(h):
                    break
        return w.calls * batch

    def store() -> int:
        for hashes in next(stores):
            for _ in range(batch):
                pop(False)
            for h in hashes:
                churn[h] = False
            for h in hashes:
                churn[h] = True
        return w.calls * batch

    return {"touch": touch, "lookup": lookup, "store": store}


def _ns_per_hash(verb: Verb) -> float:
    gc.collect()
    t0 = time.process_time()
    n = verb()
    return (time.process_time() - t0) * 1e9 / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=30_000, help="resident blocks")
    parser.add_argument("--batch", type=int, default=24, help="hashes per call")
    parser.add_argument("--calls", type=int, default=2_000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per verb (best kept)")
    parser.add_argument("--quick", action="store_true", help="a small table, one short run")
    args = parser.parse_args()
    if args.quick:
        args.size, args.calls, args.repeats = 2_000, 100, 1
    if args.size < 2 * args.batch or args.batch < 2:
        parser.error("--size must be at least twice --batch, and --batch at least 2")

    w = Workload(args.size, args.batch, args.calls, args.repeats)
    impls: dict[str, dict[str, Verb]] = {"ordereddict": reference_verbs(w)}
    if CBlockTable is not None:
        impls["c"] = table_verbs(CBlockTable, w)
    impls["python"] = table_verbs(PyBlockTable, w)
    best = {(impl, verb): float("inf") for impl in impls for verb in ("touch", "lookup", "store")}
    for _ in range(args.repeats):
        for verb in ("touch", "lookup", "store"):
            for impl, verbs in impls.items():  # interleaved: drift hits all alike
                best[impl, verb] = min(best[impl, verb], _ns_per_hash(verbs[verb]))

    print(
        f"# {args.size} resident blocks, calls of {args.batch} hashes, "
        f"best of {args.repeats} x {args.calls} calls"
    )
    if CBlockTable is None:
        print("# the C table is not built (pip install -e .): Python and the reference only")
    print(f"{'table':<13}{'verb':<8}{'ns/hash':>9}{'vs OrderedDict':>16}")
    for impl in impls:
        for verb in ("touch", "lookup", "store"):
            ns = best[impl, verb]
            ratio = ns / best["ordereddict", verb]
            print(f"{impl:<13}{verb:<8}{ns:>9.1f}{ratio:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
