"""The offloading manager: the protocol written once over a pluggable policy.

:class:`PolicyOffloadingManager` owns every invariant of the protocol (block
life cycle and reference counts, protection of the hashes a call names,
all-or-nothing eviction, events, counters); an
:class:`~kvoffload.policies.EvictionPolicy` only orders blocks and picks
victims. :class:`LRUOffloadingManager` and :class:`ARCOffloadingManager` are
the vLLM 0.11.2 names for it with a fixed starting policy.

Per resident block the policy keeps only the backend's *handle* (for
:class:`~kvoffload.backends.cpu.CPUBackend`, the ``int`` block id); the
manager keeps reference counts for the busy blocks alone (``-1`` while a
store is in flight, ``> 0`` while loads read the block), so an idle block
costs one table entry and its id (~123 bytes; vLLM's ``BlockStatus`` object
per block: ~227). :meth:`PolicyOffloadingManager.get_block` answers a
:class:`~kvoffload.backend.BlockStatus` snapshot with vLLM's ``ref_cnt``.

Threading: one thread owns a manager and calls its protocol methods. Other
threads may call :meth:`PolicyOffloadingManager.stats` snapshots published
by that thread, and read or drain :attr:`PolicyOffloadingManager.event_log`;
nothing on the hot path takes a lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter
from types import MappingProxyType

from kvoffload.abstract import (
    BlockHash,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvoffload.backend import Backend, BlockStatus
from kvoffload.errors import BlockStateError, ConfigError
from kvoffload.event_log import EventLog
from kvoffload.policies import EvictionPolicy, create_policy
from kvoffload.policies.arc import ARCPolicy
from kvoffload.stats import ManagerCounters, ManagerStats

logger = logging.getLogger(__name__)


_HASH = itemgetter(0)
_HANDLE = itemgetter(1)


def _add_counts(into: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v
    return into


def _as_list(block_hashes: Iterable[BlockHash]) -> list[BlockHash]:
    return block_hashes if type(block_hashes) is list else list(block_hashes)


class PolicyOffloadingManager(OffloadingManager):
    """An :class:`OffloadingManager` over ``backend`` whose eviction policy can
    be changed live with :meth:`switch_policy`.

    Args:
        backend: where blocks live; its free blocks at construction are the
            capacity.
        policy: a registered policy name (see
            :func:`kvoffload.policies.available_policies`).
        enable_events: record store/remove events (vLLM's switch). When off,
            :meth:`take_events` returns nothing and :attr:`event_log` is ``None``.
        event_log_capacity: size of the event ring; older events are dropped
            (and counted) when nobody drains them.
    """

    def __init__(
        self,
        backend: Backend,
        policy: str = "lru",
        enable_events: bool = False,
        event_log_capacity: int = 10_000,
    ) -> None:
        self.backend = backend
        self.capacity: int = backend.get_num_free_blocks()
        if self.capacity <= 0:
            raise ConfigError(f"backend has no free blocks (capacity {self.capacity})")
        self._policy: EvictionPolicy = create_policy(policy, self.capacity)
        self.event_log: EventLog | None = EventLog(event_log_capacity) if enable_events else None
        self._block_size = backend.block_size
        self._medium = backend.medium
        # Counters: plain ints, written by the owning thread only.
        self._lookups = 0
        self._lookup_blocks = 0
        self._hit_blocks = 0
        self._load_blocks = 0
        self._load_completed_blocks = 0
        self._touches = 0
        self._store_prepared = 0
        self._stored = 0
        self._skipped_present = 0
        self._failed = 0
        self._rejected_blocks = 0
        self._rejected_stores = 0
        # counts of the policies switched away from (the current one keeps its own)
        self._retired_ghost_hits: dict[str, int] = {}
        self._retired_evictions: dict[str, int] = {}
        self._policy_switches = 0
        # Reference counts of the busy blocks only (-1: store in flight,
        # > 0: pinned by loads); the policy reads it to skip them. A
        # resident block that is not here is ready and evictable.
        self._refs: dict[BlockHash, int] = {}
        self._pinned = 0
        self._in_flight = 0
        self._policy.busy = self._refs

    # -- introspection ----------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        """The current eviction policy object (read-only use)."""
        return self._policy

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def __len__(self) -> int:
        """Number of resident blocks (including stores in flight)."""
        return len(self._policy)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._policy

    def get_block(self, block_hash: BlockHash) -> BlockStatus | None:
        """The status of the block with this hash (a snapshot: its
        ``ref_cnt`` as of now), or ``None``."""
        handle = self._policy.get(block_hash)
        if handle is None:
            return None
        return self.backend.block_status(handle, self._refs.get(block_hash, 0))

    # -- the protocol -----------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hashes = _as_list(block_hashes)
        get = self._policy.get_idle
        hit = 0
        if self._refs:
            # A busy block is resident: ready if pinned, not if in flight.
            # get_idle may miss a pinned block, never an idle one.
            refs = self._refs.get
            in_flight = self._in_flight
            for h in hashes:
                if get(h) is None:
                    if refs(h, 0) <= 0:
                        break
                elif in_flight and refs(h, 0) < 0:
                    break
                hit += 1
        else:
            for h in hashes:
                if get(h) is None:
                    break
                hit += 1
        self._lookups += 1
        self._lookup_blocks += len(hashes)
        self._hit_blocks += hit
        return hit

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin every block for reading (ref_cnt += 1).

        Raises :class:`BlockStateError`, pinning nothing, if a block is not
        offloaded or its store is still in flight (check with :meth:`lookup`).
        """
        hashes = _as_list(block_hashes)
        handles = self._policy.get_many(hashes)
        refs = self._refs
        for h, handle in zip(hashes, handles, strict=True):
            if handle is None:
                raise BlockStateError(
                    f"cannot load block {h!r}: it is not offloaded (lookup() says how many are)"
                )
            if refs.get(h, 0) < 0:
                raise BlockStateError(
                    f"cannot load block {h!r}: its store is still in flight (not ready)"
                )
        for h in hashes:
            n = refs.get(h, 0)
            if not n:
                self._pinned += 1
            refs[h] = n + 1
        self._load_blocks += len(hashes)
        return self.backend.get_handles_spec(hashes, handles)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        hashes = _as_list(block_hashes)
        self._touches += len(hashes)
        self._policy.touch(hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin blocks pinned by :meth:`prepare_load`. Raises
        :class:`BlockStateError`, changing nothing, for a block that is not
        being loaded."""
        hashes = _as_list(block_hashes)
        refs = self._refs
        # a hash listed k times needs k pins
        for h, k in Counter(hashes).items():
            if refs.get(h, 0) < k:
                state = "not offloaded" if h not in self._policy else "not being loaded"
                raise BlockStateError(f"cannot complete load of block {h!r}: it is {state}")
        unpinned: list[BlockHash] = []
        for h in hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                unpinned.append(h)
        self._pinned -= len(unpinned)
        self._load_completed_blocks += len(hashes)
        if unpinned:
            self._policy.released(unpinned)

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Allocate blocks for the hashes not yet present (each once, in
        order), evicting unpinned ready blocks not named in this call if
        needed. Returns ``None``, with nothing changed, if there is no room."""
        # Ordered dedupe; doubles as the protected set (defects 5 and 6).
        named = dict.fromkeys(block_hashes)
        policy = self._policy
        to_store = policy.absent(named)
        backend = self.backend
        n_evict = len(to_store) - backend.get_num_free_blocks()
        evicted: list[BlockHash] = []
        if n_evict > 0:
            # More than the unpinned ready blocks: no room, known without a
            # scan (a cache full of loads and stores in flight stays O(1)).
            evictable = len(policy) - self._pinned - self._in_flight
            victims = policy.evict(n_evict, named) if n_evict <= evictable else None
            if victims is None:
                self._rejected_stores += 1
                self._rejected_blocks += len(to_store)
                return None
            backend.free_handles(map(_HANDLE, victims))
            evicted = list(map(_HASH, victims))
            if self.event_log is not None:
                self.event_log.append("removed", evicted, self._block_size, self._medium)
        handles = backend.allocate_handles(to_store)
        policy.insert(to_store, handles)
        self._refs.update(dict.fromkeys(to_store, -1))
        n = len(to_store)
        self._in_flight += n
        self._store_prepared += n
        self._skipped_present += len(named) - n
        return PrepareStoreOutput(
            block_hashes_to_store=to_store,
            store_spec=backend.get_handles_spec(to_store, handles),
            block_hashes_evicted=evicted,
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Make in-flight blocks readable, or with ``success=False`` free and
        forget them. Blocks that were already ready are left as they are in
        both cases. Raises :class:`BlockStateError`, changing nothing, for a
        hash that was never prepared (or already failed)."""
        hashes = _as_list(block_hashes)
        refs = self._refs
        if success:
            # The usual call completes stores in flight, each named once:
            # one C-level pass takes them off the busy table.
            done = list(map(refs.pop, hashes, repeat(0)))
            if done.count(-1) == len(done):
                self._in_flight -= len(hashes)
                self._stored += len(hashes)
                self._stores_done(hashes)
                return
            refs.update((h, r) for h, r in zip(hashes, done, strict=True) if r)
        policy = self._policy
        for h in hashes:
            if h not in policy:
                raise BlockStateError(
                    f"cannot complete store of block {h!r}: it was not prepared "
                    "(or its store already failed)"
                )
        in_flight = [h for h in dict.fromkeys(hashes) if refs.get(h, 0) < 0]
        for h in in_flight:
            del refs[h]
        self._in_flight -= len(in_flight)
        if success:
            self._stored += len(in_flight)
            self._stores_done(in_flight)
        else:
            self.backend.free_handles([policy.remove(h) for h in in_flight])
            self._failed += len(in_flight)

    def _stores_done(self, stored: list[BlockHash]) -> None:
        if stored:
            self._policy.stored(stored)
            if self.event_log is not None:
                self.event_log.append("stored", stored, self._block_size, self._medium)

    def take_events(self) -> list[OffloadingEvent]:
        """Drain the log and return its store/remove events (vLLM behaviour).
        Other records (policy switches, clears) are drained too."""
        if self.event_log is None:
            return []
        events = []
        for record in self.event_log.drain():
            ev = record.to_offloading_event()
            if ev is not None:
                events.append(ev)
        return events

    # -- beyond vLLM ------------------------------------------------------

    def switch_policy(self, policy: str) -> str:
        """Change the eviction policy in place; returns the previous name.

        Every resident block stays, with its block id and reference count;
        in-flight stores and loads are untouched; counters continue. The old
        policy's order (first-evicted first) seeds the new one; ghost history
        does not carry over. Raises :class:`~kvoffload.errors.PolicyError`
        for an unknown name, changing nothing.
        """
        new = create_policy(policy, self.capacity)
        new.busy = self._refs
        old = self._policy
        new.seed(old.ordered_items())
        assert len(new) == len(old), "policy migration lost blocks"
        _add_counts(self._retired_ghost_hits, old.ghost_hits)
        _add_counts(self._retired_evictions, old.evictions)
        self._policy = new
        self._policy_switches += 1
        if self.event_log is not None:
            self.event_log.append("policy_switched", detail={"from": old.name, "to": new.name})
        logger.info("eviction policy switched from %s to %s", old.name, new.name)
        return old.name

    def clear(self) -> list[BlockHash]:
        """Evict every resident, unpinned, ready block and forget ghost
        history. Pinned blocks and stores in flight are kept. Returns the
        evicted hashes (one ``removed`` event plus a ``cleared`` record)."""
        policy = self._policy
        evictable = len(policy) - self._pinned - self._in_flight
        evicted: list[BlockHash] = []
        if evictable:
            victims = policy.evict(evictable, ())
            assert victims is not None
            self.backend.free_handles(map(_HANDLE, victims))
            evicted = list(map(_HASH, victims))
        policy.clear_ghosts()
        if self.event_log is not None:
            if evicted:
                self.event_log.append("removed", evicted, self._block_size, self._medium)
            self.event_log.append("cleared", detail={"evicted": str(len(evicted))})
        return evicted

    def stats(self) -> ManagerStats:
        """An immutable snapshot. Call it on the owning thread (or hand the
        snapshot to others): it reads counters without a lock."""
        policy = self._policy
        used = len(policy)
        ghost = _add_counts(dict(self._retired_ghost_hits), policy.ghost_hits)
        evictions = _add_counts(dict(self._retired_evictions), policy.evictions)
        counters = ManagerCounters(
            lookups=self._lookups,
            lookup_blocks=self._lookup_blocks,
            hit_blocks=self._hit_blocks,
            load_blocks=self._load_blocks,
            load_completed_blocks=self._load_completed_blocks,
            touches=self._touches,
            store_prepared_blocks=self._store_prepared,
            store_blocks=MappingProxyType(
                {
                    "stored": self._stored,
                    "skipped_present": self._skipped_present,
                    "failed": self._failed,
                    "rejected_no_room": self._rejected_blocks,
                }
            ),
            rejected_stores=self._rejected_stores,
            evictions=MappingProxyType(evictions),
            ghost_hits=MappingProxyType(ghost),
            policy_switches=self._policy_switches,
        )
        return ManagerStats(
            policy=policy.name,
            medium=self._medium,
            block_size=self._block_size,
            capacity=self.capacity,
            used=used,
            free=self.backend.get_num_free_blocks(),
            pinned=self._pinned,
            in_flight=self._in_flight,
            lists=MappingProxyType(policy.list_sizes()),
            params=MappingProxyType(policy.params()),
            counters=counters,
            events=self.event_log.stats() if self.event_log is not None else None,
        )


class LRUOffloadingManager(PolicyOffloadingManager):
    """vLLM's LRU manager: a :class:`PolicyOffloadingManager` starting on LRU."""

    def __init__(self, backend: Backend, enable_events: bool = False) -> None:
        super().__init__(backend, policy="lru", enable_events=enable_events)


class ARCOffloadingManager(PolicyOffloadingManager):
    """vLLM's ARC manager: a :class:`PolicyOffloadingManager` starting on ARC,
    exposing ARC's lists and target as vLLM does (while ARC is the policy)."""

    def __init__(self, backend: Backend, enable_events: bool = False) -> None:
        super().__init__(backend, policy="arc", enable_events=enable_events)

    def _arc(self) -> ARCPolicy:
        p = self._policy
        if not isinstance(p, ARCPolicy):
            raise AttributeError(
                f"ARC lists are unavailable: the policy was switched to {p.name!r}"
            )
        return p

    t1 = property(
        lambda self: self._arc().t1,
        doc="T1: blocks used once, LRU first (hash -> handle, the block id on a CPUBackend).",
    )
    t2 = property(
        lambda self: self._arc().t2,
        doc="T2: blocks used twice or more, LRU first (hash -> handle).",
    )
    b1 = property(lambda self: self._arc().b1, doc="B1: ghosts of blocks evicted from T1.")
    b2 = property(lambda self: self._arc().b2, doc="B2: ghosts of blocks evicted from T2.")

    @property
    def cache_capacity(self) -> int:
        return self.capacity

    @property
    def target_t1_size(self) -> float:
        return self._arc().target_t1_size

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        self._arc().target_t1_size = value
