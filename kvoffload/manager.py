"""The offloading manager: the protocol written once over a pluggable policy.

:class:`PolicyOffloadingManager` owns every invariant of the protocol (block
life cycle and reference counts, protection of the hashes a call names,
all-or-nothing eviction, events, counters); an
:class:`~kvoffload.policies.EvictionPolicy` only orders blocks and picks
victims. :class:`LRUOffloadingManager` and :class:`ARCOffloadingManager` are
the vLLM 0.11.2 names for it with a fixed starting policy.

Every block lives in one :class:`~kvoffload.table.BlockTable` entry: its
hash, the backend's *handle* (for :class:`~kvoffload.backends.cpu.CPUBackend`,
the ``int`` block id), its reference count (``-1`` while its store is in
flight, ``> 0`` while loads read it) and its place in the policy's lists;
ghosts are entries too. Each verb is a few calls on the table whatever the
number of blocks (the C table does the per-block work).
:meth:`PolicyOffloadingManager.get_block` answers a
:class:`~kvoffload.backend.BlockStatus` snapshot with vLLM's ``ref_cnt``.

Hints: :meth:`PolicyOffloadingManager.hint` tells the manager which blocks a
request waiting to be served will use, :meth:`PolicyOffloadingManager.unhint`
that it left the queue. The manager keeps this *window* in its table whatever
the policy (it survives policy switches and :meth:`~PolicyOffloadingManager.clear`);
a policy that uses hints (``hkvarc``) orders blocks by it, the others ignore it.

Threading: one thread owns a manager and calls its protocol methods. Other
threads may call :meth:`PolicyOffloadingManager.stats` snapshots published
by that thread, and read or drain :attr:`PolicyOffloadingManager.event_log`;
nothing on the hot path takes a lock.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType

from kvoffload import policies
from kvoffload._checks import is_finite_number
from kvoffload.abstract import (
    BlockHash,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvoffload.backend import Backend, BlockStatus
from kvoffload.errors import (
    BlockStateError,
    ConfigError,
    PolicyContractError,
    PolicyError,
    PolicyFailedError,
)
from kvoffload.event_log import DEFAULT_CAPACITY, EventLog
from kvoffload.policies import EvictionPolicy, Victims, create_policy
from kvoffload.policies.arc import ARCPolicy
from kvoffload.stats import ManagerCounters, ManagerStats, WindowStats
from kvoffload.table import BlockTable

__all__ = ["ARCOffloadingManager", "LRUOffloadingManager", "PolicyOffloadingManager"]

logger = logging.getLogger(__name__)


def _add_counts(into: dict[str, int], counts: Mapping[str, int]) -> dict[str, int]:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v
    return into


def _lists_left(before: dict[str, int], after: dict[str, int]) -> dict[str, str]:
    """Which lists an eviction's victims left, and how many each (a ``removed``
    event's detail), from the policy's eviction counts before and after it."""
    return {k: str(n - before.get(k, 0)) for k, n in after.items() if n != before.get(k, 0)}


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
        event_log_capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if not isinstance(enable_events, bool):  # "no" is truthy: it turned events on
            raise ConfigError(f"enable_events must be True or False, got {enable_events!r}")
        self.backend = backend
        self.capacity: int = backend.get_num_free_blocks()
        if self.capacity <= 0:
            raise ConfigError(f"backend has no free blocks (capacity {self.capacity})")
        self._table = BlockTable()
        # no Python frame: the table takes the calls as they are (and raises
        # unhint's UnknownTicketError itself)
        if type(self).hint is PolicyOffloadingManager.hint:
            self.hint = self._table.hint  # type: ignore[method-assign,assignment]
        if type(self).unhint is PolicyOffloadingManager.unhint:
            self.unhint = self._table.unhint  # type: ignore[method-assign,assignment]
        self._policy: EvictionPolicy = create_policy(policy, self.capacity, self._table)
        self._policy.seed([])
        self._hook(self._policy)
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
        #: each former policy's own counts, by policy name
        self._retired_counts: dict[str, dict[str, int]] = {}
        self._policy_switches = 0

    def _hook(self, policy: EvictionPolicy) -> None:
        """Ask the policy to admit stores only if it may decline some: the
        hot path of the others gains one ``is None`` test. A policy of one's
        own has its answers checked; kvoffload's are not (their victims come
        from the table's own ``evict``)."""
        self._admit = policy.admit if type(policy).admit is not EvictionPolicy.admit else None
        self._trusted = policies.is_builtin(type(policy))

    # -- introspection ----------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        """The current eviction policy object (read-only use)."""
        return self._policy

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def table(self) -> BlockTable:
        """The block table (read-only use)."""
        return self._table

    def __len__(self) -> int:
        """Number of resident blocks (including stores in flight)."""
        return len(self._table)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._table

    def get_block(self, block_hash: BlockHash) -> BlockStatus | None:
        """The status of the block with this hash (a snapshot: its
        ``ref_cnt`` as of now), or ``None``."""
        table = self._table
        handle = table.get(block_hash)
        if handle is None:
            return None
        return self.backend.block_status(handle, table.ref(block_hash) or 0)

    # -- the protocol -----------------------------------------------------

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        hashes = _as_list(block_hashes)
        hit: int = self._table.lookup(hashes)
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
        try:
            handles = self._table.pin(hashes)
        except KeyError as e:
            raise BlockStateError(
                f"cannot load block {e.args[0]!r}: it is not offloaded (lookup() says how many are)"
            ) from None
        except ValueError as e:
            raise BlockStateError(
                f"cannot load block {e.args[0]!r}: its store is still in flight (not ready)"
            ) from None
        self._load_blocks += len(hashes)
        return self.backend.get_handles_spec(hashes, handles)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        hashes = _as_list(block_hashes)
        self._touches += len(hashes)
        self._policy.touch(hashes)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Unpin blocks pinned by :meth:`prepare_load`. Raises
        :class:`BlockStateError`, changing nothing, for a block that is not
        being loaded (a hash listed k times needs k pins)."""
        hashes = _as_list(block_hashes)
        try:
            self._table.unpin(hashes)
        except (KeyError, ValueError) as e:
            state = "not offloaded" if isinstance(e, KeyError) else "not being loaded"
            raise BlockStateError(
                f"cannot complete load of block {e.args[0]!r}: it is {state}"
            ) from None
        self._load_completed_blocks += len(hashes)

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Allocate blocks for the hashes not yet present (each once, in
        order), evicting unpinned ready blocks not named in this call if
        needed. Returns ``None``, with nothing changed, if there is no room.

        A policy may decline part of a store that would evict
        (:meth:`~kvoffload.policies.EvictionPolicy.admit`; ``hkvarc`` does,
        with hints): then ``block_hashes_to_store`` is the prefix of the
        absent hashes it keeps, and only those may be completed."""
        # Ordered dedupe; doubles as the protected set (defects 5 and 6).
        named = dict.fromkeys(block_hashes)
        table = self._table
        to_store = table.absent(named)
        absent = len(to_store)
        backend = self.backend
        n_evict = absent - backend.get_num_free_blocks()
        # The policy may decline blocks only when the victims may have to
        # include blocks a waiting request uses: the ready blocks, less the
        # hinted ones and the ones this call names, are too few. (A lower
        # bound of them: a busy hinted block is subtracted twice. The policy
        # counts exactly.)
        if (
            n_evict > 0
            and self._admit is not None
            and n_evict
            > len(table)
            - table.pinned
            - table.in_flight
            - table.window_resident
            - (len(named) - absent)
        ):
            keep = self._admit(to_store, n_evict, named)
            if not self._trusted and not (type(keep) is int and 0 <= keep <= absent):
                raise self._breach(
                    f"admit answered {keep!r}, not an int from 0 to {absent}", changed=False
                )
            if keep < absent:
                to_store = to_store[:keep]
                n_evict -= absent - keep
        evicted: list[BlockHash] = []
        if n_evict > 0:
            # More than the unpinned ready blocks: no room, known without a
            # scan (a cache full of loads and stores in flight stays O(1)).
            evictable = len(table) - table.pinned - table.in_flight
            log, policy = self.event_log, self._policy
            before = dict(policy.evictions) if log is not None else {}
            if n_evict > evictable:
                victims = None
            elif self._trusted:  # no frame more on the hot path of kvoffload's policies
                victims = policy.evict(n_evict, named)
            else:
                victims = self._checked_evict(n_evict, named)
            if victims is None:
                self._rejected_stores += 1
                self._rejected_blocks += len(to_store)
                return None
            evicted, freed = victims
            backend.free_handles(freed)
            if log is not None:
                left = _lists_left(before, policy.evictions)
                log.append("removed", evicted, self._block_size, self._medium, left)
        handles = backend.allocate_handles(to_store)
        self._policy.insert(to_store, handles)
        self._store_prepared += len(to_store)
        self._skipped_present += len(named) - absent
        return PrepareStoreOutput(
            block_hashes_to_store=to_store,
            store_spec=backend.get_handles_spec(to_store, handles),
            block_hashes_evicted=evicted,
        )

    def _checked_evict(self, n: int, protected: Collection[BlockHash]) -> Victims | None:
        """The ``evict`` of a policy of one's own, its answer checked against
        the contract before anything is freed (a policy that answered a
        victim twice, too many or too few, or a block the call names, freed a
        block id twice or lost one, and a replay reported hits no cache can
        have, with no error)."""
        policy, table = self._policy, self._table
        resident = len(table)
        victims = policy.evict(n, protected)
        removed = resident - len(table)
        if victims is None:
            if removed:
                raise self._breach(f"evict answered None but removed {removed} blocks")
            return None
        try:
            hashes, handles = victims
            count, distinct = len(hashes), len(set(hashes))
            n_handles = len(handles)
        except (TypeError, ValueError):
            raise self._breach(
                f"evict answered {type(victims).__name__}, not (hashes, handles)"
            ) from None
        if count != n or n_handles != n:
            problem = f"{count} hashes and {n_handles} handles for the {n} victims asked"
        elif distinct != n:
            problem = "a victim more than once"
        elif removed != n:
            problem = f"{n} victims but {removed} blocks removed from the table"
        else:
            named = [h for h in hashes if h in protected]
            kept = [h for h in hashes if h in table]
            if not named and not kept:
                return hashes, handles
            problem = (
                f"victim {named[0]!r}, which the call names (protected)"
                if named
                else f"victim {kept[0]!r}, still resident"
            )
        raise self._breach(f"evict answered {problem}")

    def _breach(self, problem: str, *, changed: bool = True) -> PolicyContractError:
        """The error for a policy's answer out of contract; ``changed``: the
        policy changed the table before it answered."""
        after = (
            "this manager is not to be used again"
            if changed
            else "nothing was changed, the manager works on"
        )
        return PolicyContractError(
            f"eviction policy {self._policy.name!r} broke its contract: {problem} "
            f"(see docs/writing-a-policy.md); {after}"
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Make in-flight blocks readable, or with ``success=False`` free and
        forget them. Blocks that were already ready are left as they are in
        both cases. Raises :class:`BlockStateError`, changing nothing, for a
        hash that was never prepared (or already failed)."""
        table = self._table
        try:
            if success:
                stored = table.complete(block_hashes)
            else:
                failed = table.fail(block_hashes)
        except KeyError as e:
            raise BlockStateError(
                f"cannot complete store of block {e.args[0]!r}: it was not prepared "
                "(or its store already failed)"
            ) from None
        if success:
            self._stored += len(stored)
            if stored and self.event_log is not None:
                self.event_log.append("stored", stored, self._block_size, self._medium)
        else:
            self.backend.free_handles(failed)
            self._failed += len(failed)

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

    # -- beyond vLLM: the hint window -------------------------------------

    def hint(self, block_hashes: Iterable[BlockHash]) -> int:
        """A request waiting to be served joins the hint window: it will use
        ``block_hashes`` (its chain, in prefix order), after every request
        hinted before it and still in the window. Returns its ticket for
        :meth:`unhint`.

        Any hashes may be hinted (offloaded, evicted, never seen; a repeat
        is one more use). Hints change no block and no answer by themselves:
        a policy that uses them (``hkvarc``) orders blocks by their next use
        in the window, every other policy ignores them. The window is the
        manager's, not the policy's: it survives :meth:`switch_policy` (a
        policy switched to sees it at once) and :meth:`clear`. Cost: one
        table look-up per hash; nothing is rescanned later.
        """
        ticket: int = self._table.hint(block_hashes)
        return ticket

    def unhint(self, ticket: int) -> None:
        """The request of ``ticket`` left the waiting queue: it is about to
        be served (call this right before its ``touch`` and ``lookup``, so
        that its own blocks are no longer counted as coming), or it was
        aborted or preempted. Tickets may leave in any order.

        Raises :class:`~kvoffload.errors.UnknownTicketError`, changing
        nothing, for a ticket that is not in the window (never returned by
        :meth:`hint` of this manager, or already unhinted). Cost: O(hashes
        of the request), with no hashing.
        """
        self._table.unhint(ticket)  # the table raises UnknownTicketError itself

    # -- beyond vLLM ------------------------------------------------------

    def switch_policy(self, policy: str) -> str:
        """Change the eviction policy in place; returns the previous name.

        Every resident block stays, with its block id and reference count;
        in-flight stores and loads are untouched; counters continue (a
        policy's own, :meth:`~kvoffload.policies.EvictionPolicy.counters`,
        add up over every time it is the policy); the hint window is kept. The old
        policy's order (first-evicted first) seeds the new one; ghost history
        does not carry over. Raises :class:`~kvoffload.errors.PolicyError`
        for an unknown name, changing nothing, and
        :class:`~kvoffload.errors.PolicyFailedError` for a registered policy
        (one of your own) whose class does not import or whose constructor
        raises, changing nothing either.

        A policy whose ``seed`` raises does not take over: the old policy's
        class takes the blocks back in its order (its ghost history is lost)
        and :class:`~kvoffload.errors.PolicyFailedError` says so, the manager
        working as before.

        Switching to the policy in use changes nothing: its lists, ghosts
        and target stay, no ``policy_switched`` record is logged and
        the ``policy_switches`` counter does not count it (a retried switch loses no
        learned state; :meth:`clear` is the reset).
        """
        table = self._table
        old = self._policy
        if policies.policy_class(policy) is type(old):
            return old.name
        try:
            new = create_policy(policy, self.capacity, table)
        except PolicyError:
            raise
        except Exception as exc:  # a constructor of one's own: nothing changed yet
            raise PolicyFailedError(
                f"eviction policy {policy!r} could not be built ({type(exc).__name__}: {exc}); "
                f"{old.name} stays"
            ) from exc
        items = old.ordered_items()
        assert len(items) == len(table), "policy migration lost blocks"
        old_counts = old.counters()  # before the table forgets the policy
        old_ghost_hits, old_evictions = dict(old.ghost_hits), dict(old.evictions)
        table.forget_policy()  # its ghosts and touch rules
        try:
            new.seed(items)
        except Exception as exc:
            # A policy of someone's own failed to take the blocks: the old
            # policy's class takes them back, in its order (its ghosts are
            # gone with the table's), so that the manager keeps working.
            table.forget_policy()
            back = create_policy(old.name, self.capacity, table)
            back.seed(items)
            # what the fresh copy counts for taking them back (hkvarc: the
            # blocks it holds again) was counted once already
            reseeded = back.counters()
            self._retire(old, back, old_counts, old_ghost_hits, old_evictions)
            _add_counts(self._retired_counts[old.name], {k: -v for k, v in reseeded.items()})
            raise PolicyFailedError(
                f"eviction policy {policy!r} failed to take over the blocks "
                f"({type(exc).__name__}: {exc}); {old.name} is back, its ghost history lost"
            ) from exc
        self._retire(old, new, old_counts, old_ghost_hits, old_evictions)
        self._policy_switches += 1
        if self.event_log is not None:
            self.event_log.append("policy_switched", detail={"from": old.name, "to": new.name})
        logger.info("eviction policy switched from %s to %s", old.name, new.name)
        return old.name

    def _retire(
        self,
        old: EvictionPolicy,
        new: EvictionPolicy,
        counts: Mapping[str, int],
        ghost_hits: Mapping[str, int],
        evictions: Mapping[str, int],
    ) -> None:
        """``new`` is the policy; ``old``'s counts (read before the table
        forgot it) go on in the manager's totals."""
        _add_counts(self._retired_ghost_hits, ghost_hits)
        _add_counts(self._retired_evictions, evictions)
        _add_counts(self._retired_counts.setdefault(old.name, {}), counts)
        self._policy = new
        self._hook(new)

    def clear(self) -> list[BlockHash]:
        """Evict every resident, unpinned, ready block and forget ghost
        history. Pinned blocks and stores in flight are kept, and so is the
        hint window (hints are about the requests waiting, not about what
        is resident: those requests still come). Returns the evicted hashes
        (one ``removed`` event plus a ``cleared`` record)."""
        policy, table = self._policy, self._table
        evictable = len(table) - table.pinned - table.in_flight
        evicted: list[BlockHash] = []
        before = dict(policy.evictions)
        if evictable:
            victims = (
                policy.evict(evictable, ()) if self._trusted else self._checked_evict(evictable, ())
            )
            if victims is None:  # nothing removed, or _checked_evict said so
                raise self._breach(
                    f"evict answered None at a clear, which evicts every idle block "
                    f"({evictable}, none protected)",
                    changed=False,
                )
            evicted, freed = victims
            self.backend.free_handles(freed)
        policy.clear_ghosts()
        if self.event_log is not None:
            if evicted:
                left = _lists_left(before, policy.evictions)
                self.event_log.append("removed", evicted, self._block_size, self._medium, left)
            self.event_log.append("cleared", detail={"evicted": str(len(evicted))})
        return evicted

    def stats(self) -> ManagerStats:
        """An immutable snapshot. Call it on the owning thread (or hand the
        snapshot to others): it reads counters without a lock."""
        policy, table = self._policy, self._table
        used = len(table)
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
            pinned=table.pinned,
            in_flight=table.in_flight,
            lists=MappingProxyType(policy.list_sizes()),
            params=MappingProxyType(policy.params()),
            counters=counters,
            events=self.event_log.stats() if self.event_log is not None else None,
            ghost_list_names=policy.ghost_list_names,
            window=WindowStats(
                requests=table.window_requests,
                uses=table.window_uses,
                blocks=table.window_keys,
                resident=table.window_resident,
            ),
            policy_counters=MappingProxyType(
                _add_counts(dict(self._retired_counts.get(policy.name, {})), policy.counters())
            ),
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
        # checked here: a string, nan or inf once went in and broke stats()
        # and the next evicting store. Any finite number goes, as in vLLM
        # (ARC's rules treat one above the capacity as the capacity)
        if not is_finite_number(value):
            raise ConfigError(f"target_t1_size must be a finite number of blocks, got {value!r}")
        self._arc().target_t1_size = float(value)
