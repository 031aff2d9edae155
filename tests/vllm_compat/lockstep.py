"""vLLM 0.11.2's manager and kvoffload's, driven call by call in lockstep.

:class:`Lockstep` makes the same protocol calls on both managers of one kind
(LRU or ARC) and requires the same answer from each call and the same state
after it: every list in order with each block's id and ``ref_cnt``, the free
count, ARC's ghost lists and target, and the events.

Stores may complete many calls later or fail, and loads may stay pinned
across evictions, which is where eviction has to pass busy blocks. Calls
that would run into one of vLLM's own defects, where kvoffload is meant to
differ (DESIGN.md section 4), are not made; each such call is recorded in
:attr:`Lockstep.skipped` with the defect's number. Exactly those are left
out, decided on a copy of vLLM's manager where that takes running it:

* 1: an ARC ``touch`` of a T1 block whose store is in flight (vLLM raises
  ``KeyError`` half-way through the touch): that hash is left out of it;
* 2: an ARC ``complete_store(success=False)`` naming a ready block (vLLM
  forgets it without freeing it): failed stores name only their own blocks;
* 3 and 4: an ARC ``prepare_store`` where vLLM evicts some blocks and then
  gives up, or gives up while kvoffload falls back to the other list;
* 5: a ``prepare_store`` where vLLM would evict a block the same call names;
* 6: a ``prepare_store`` naming a hash that is not stored twice (vLLM
  allocates it twice): the repeat is dropped, repeats of stored hashes stay.

Defects 9 (an unbounded event list) and 10 (rescans past busy blocks) do not
change answers.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import kvoffload

Lists = dict[str, Any]


def managers(vllm: Any, kind: str, capacity: int, events: bool = True) -> tuple[Any, Any]:
    """vLLM's manager and ours, of the same kind and capacity."""
    name = "LRUOffloadingManager" if kind == "lru" else "ARCOffloadingManager"
    return (
        getattr(vllm, name)(vllm.CPUBackend(16, capacity), enable_events=events),
        getattr(kvoffload, name)(kvoffload.CPUBackend(16, capacity), enable_events=events),
    )


def vllm_lists(m: Any, kind: str) -> Lists:
    """Every ordered list of vLLM's manager: (hash, block id, ref_cnt)."""
    lists: Lists = {"free": m.backend.get_num_free_blocks()}
    if kind == "lru":
        lists["lru"] = [(h, b.block_id, b.ref_cnt) for h, b in m.blocks.items()]
        return lists
    for name in ("t1", "t2"):
        lists[name] = [(h, b.block_id, b.ref_cnt) for h, b in getattr(m, name).items()]
    lists.update(b1=list(m.b1), b2=list(m.b2), target=m.target_t1_size)
    return lists


def our_lists(m: Any, kind: str) -> Lists:
    """The same for kvoffload's manager (the handle of a CPUBackend block is its id)."""
    lists: Lists = {"free": m.backend.get_num_free_blocks()}
    ref = m.table.ref
    if kind == "lru":
        lists["lru"] = [(h, i, ref(h)) for h, i in m.policy.ordered_items()]
        return lists
    for name in ("t1", "t2"):
        lists[name] = [(h, i, ref(h)) for h, i in getattr(m, name).items()]
    lists.update(b1=list(m.b1), b2=list(m.b2), target=m.target_t1_size)
    return lists


def events(m: Any) -> list[tuple[list[bytes], int, str, bool]]:
    return [(list(e.block_hashes), e.block_size, e.medium, e.removed) for e in m.take_events()]


def ids(spec: Any) -> list[int]:
    return [int(i) for i in spec.block_ids]


class Lockstep:
    """Both managers of ``kind`` with ``capacity`` blocks; each method makes
    one protocol call on both and asserts that they agree."""

    def __init__(self, vllm: Any, kind: str, capacity: int) -> None:
        self.kind = kind
        self.theirs, self.ours = managers(vllm, kind, capacity)
        #: hashes of prepared stores not completed yet, oldest first
        self.stores: list[list[bytes]] = []
        #: hashes of loads still pinned, oldest first
        self.loads: list[list[bytes]] = []
        #: calls left out, by the vLLM defect they would have run into
        self.skipped: Counter[int] = Counter()
        #: evictions made, and how many of them passed a busy block
        self.evictions = 0
        self.passed_busy = 0

    def check(self) -> None:
        theirs, ours = vllm_lists(self.theirs, self.kind), our_lists(self.ours, self.kind)
        assert theirs == ours, f"vLLM: {theirs}\nkvoffload: {ours}"

    # -- stores ---------------------------------------------------------------

    def store(self, hashes: list[bytes], complete: bool | None = None) -> None:
        """``prepare_store(hashes)``; completed right away when ``complete``
        is ``True`` (``False``: failed), else left in flight."""
        ours, theirs = self.ours, self.theirs
        seen: set[bytes] = set()
        named = []
        for h in hashes:
            if h in seen and h not in ours:
                self.skipped[6] += 1
                continue
            seen.add(h)
            named.append(h)
        probe = copy.deepcopy(theirs)
        out = probe.prepare_store(named)
        if out is not None and set(out.block_hashes_evicted) & seen:
            self.skipped[5] += 1
            return
        if out is None and vllm_lists(probe, self.kind) != vllm_lists(theirs, self.kind):
            self.skipped[3] += 1
            return
        if out is None and self._kvoffload_has_room(named):
            self.skipped[4] += 1
            return
        busy_before = self._busy_older_than_victims(out)
        out_v, out_k = theirs.prepare_store(named), ours.prepare_store(named)
        assert (out_v is None) == (out_k is None), named
        if out_v is None:
            return
        assert out_v.block_hashes_to_store == out_k.block_hashes_to_store
        assert out_v.block_hashes_evicted == out_k.block_hashes_evicted
        assert ids(out_v.store_spec) == ids(out_k.store_spec)
        if out_v.block_hashes_evicted:
            self.evictions += 1
            self.passed_busy += busy_before
        to_store = list(out_v.block_hashes_to_store)
        if not to_store:
            return
        if complete is None:
            self.stores.append(to_store)
        else:
            self._complete(to_store, complete)

    def _kvoffload_has_room(self, named: list[bytes]) -> bool:
        """Whether kvoffload's ``prepare_store(named)`` would succeed: it
        needs as many evictable blocks the call does not name as it lacks."""
        ours = self.ours
        need = len(ours.table.absent(dict.fromkeys(named))) - ours.backend.get_num_free_blocks()
        protected = set(named)
        evictable = [
            h
            for h, _ in ours.policy.ordered_items()
            if ours.table.ref(h) == 0 and h not in protected
        ]
        return need <= len(evictable)

    def _busy_older_than_victims(self, out: Any) -> bool:
        """Whether the eviction ``out`` (vLLM's, on a copy) passes a busy block."""
        if out is None or not out.block_hashes_evicted:
            return False
        m, victims = self.theirs, set(out.block_hashes_evicted)
        orders = [m.blocks] if self.kind == "lru" else [m.t1, m.t2]
        for order in orders:
            left = len(victims & set(order))
            for h, b in order.items():
                if not left:
                    break
                if h in victims:
                    left -= 1
                elif b.ref_cnt != 0:
                    return True
        return False

    def complete_store(self, i: int, success: bool, extra: list[bytes]) -> None:
        """Complete the ``i``-th pending store; ``extra`` ready hashes are
        named too where vLLM handles that (not in a failed ARC store: defect 2)."""
        hashes = self.stores.pop(i % len(self.stores))
        if not success and self.kind == "arc":
            extra = []
        ready = [h for h in dict.fromkeys(extra) if self.ours.table.ref(h) not in (None, -1)]
        self._complete(hashes + [h for h in ready if h not in hashes], success)

    def _complete(self, hashes: list[bytes], success: bool) -> None:
        self.theirs.complete_store(hashes, success=success)
        self.ours.complete_store(hashes, success=success)

    # -- loads, touches, look-ups --------------------------------------------

    def load(self, hashes: list[bytes], hold: bool) -> None:
        """Pin the ready prefix of ``hashes``; unpinned again at once unless
        ``hold``."""
        hit = self.ours.lookup(hashes)
        assert self.theirs.lookup(hashes) == hit
        prefix = hashes[:hit]
        if not prefix:
            return
        assert ids(self.theirs.prepare_load(prefix)) == ids(self.ours.prepare_load(prefix))
        if hold:
            self.loads.append(prefix)
        else:
            self.theirs.complete_load(prefix)
            self.ours.complete_load(prefix)

    def complete_load(self, i: int) -> None:
        hashes = self.loads.pop(i % len(self.loads))
        self.theirs.complete_load(hashes)
        self.ours.complete_load(hashes)

    def touch(self, hashes: list[bytes]) -> None:
        if self.kind == "arc":
            t1 = self.theirs.t1
            kept = [h for h in hashes if not (h in t1 and t1[h].ref_cnt < 0)]
            self.skipped[1] += len(kept) < len(hashes)
            hashes = kept
        self.theirs.touch(hashes)
        self.ours.touch(hashes)

    def lookup(self, hashes: list[bytes]) -> None:
        assert self.theirs.lookup(hashes) == self.ours.lookup(hashes)

    def events(self) -> None:
        assert events(self.theirs) == events(self.ours)

    def set_target(self, target: float) -> None:
        assert self.kind == "arc"
        self.theirs.target_t1_size = self.ours.target_t1_size = target
