"""Offline replay of a workload against an offloading manager, and Belady's
optimal hit ratio as the upper bound to compare it with.

The replay drives a manager alone (no engine, no transfers), one offloaded
block per trace block id. Per request, in this order::

    touch(all hashes); hit = lookup(all hashes)
    out = prepare_store(hashes[hit:]); complete_store(out.block_hashes_to_store)

so a request's hits are the longest prefix of its blocks that is resident,
and its missing blocks are stored right away (all of them, unless the policy
declines some: ``hkvarc`` may, with hints). A store with no room
(``prepare_store`` returns ``None``) is counted as rejected and skipped.

With a lookahead of ``W`` requests the replay plays an engine's waiting
queue: while request ``i`` is served, requests ``i+1 .. i+W`` are in the
manager's hint window (the request being served is not one of the ``W``).
The first ``W`` are hinted before the first request; before request ``i``,
request ``i+W`` is hinted and request ``i`` unhinted, then it is served as
above. Policies that do not use hints give the same hits at every ``W``.

:func:`belady` applies the same prefix semantics with perfect knowledge of
the future: it evicts the block whose next use is furthest away. With
``bypass=True`` it may also leave a missed block unstored (when it is used
after every block it could evict): the bound for a policy that declines
stores, as ``hkvarc`` does with hints.

A manager call that raises during a replay (a policy of one's own that
breaks, or breaks its contract) is re-raised as :class:`ReplayError`, which
names the policy, the trace and the request.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import TypeVar

from kvoffload._checks import abridged, described, is_int
from kvoffload.abstract import BlockHash, OffloadingManager, SupportsHints
from kvoffload.backends.cpu import CPUBackend
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.runtime.workloads import Request, Workload, engine_block_hashes

__all__ = [
    "BeladyResult",
    "ReplayError",
    "ReplayResult",
    "ReplayTrace",
    "belady",
    "parse_capacity",
    "replay",
]

K = TypeVar("K", bound=Hashable)

#: requests between two calls of a replay's ``progress`` callback
PROGRESS_EVERY = 256


# --------------------------------------------------------------------------- input


@dataclass(frozen=True, slots=True)
class ReplayTrace:
    """A workload prepared for replay: one block hash per trace block id.

    Hashing is done once here, outside the timed manager calls, and shared by
    every (policy, capacity) run of the trace.
    """

    name: str
    #: one tuple of chained block hashes per request, in arrival order
    block_hashes: tuple[tuple[BlockHash, ...], ...]
    trace_block_size: int

    @classmethod
    def from_requests(
        cls, requests: Iterable[Request], *, name: str, trace_block_size: int
    ) -> ReplayTrace:
        """Hash each request's block ids at the trace block size (see
        :func:`~kvoffload.runtime.workloads.engine_block_hashes`).

        Raises :class:`ConfigError` for a :class:`Workload` that does not say
        how many requests it has (``len_hint`` is ``None``: endless, as
        ``SyntheticConfig(num_requests=None)`` and ``loop()`` are), which a
        replay would read forever.
        """
        if isinstance(requests, Workload) and requests.len_hint is None:
            raise ConfigError(
                f"cannot replay this {type(requests).__name__}: its len_hint is None (endless, "
                "or of no known length), so the replay could read forever; give it a number "
                "of requests (SyntheticConfig(num_requests=N)) or pass its first N requests "
                "(itertools.islice(workload, N))"
            )
        hashes = tuple(
            tuple(
                engine_block_hashes(
                    r.block_ids,
                    trace_block_size=trace_block_size,
                    engine_block_size=trace_block_size,
                )
            )
            for r in requests
        )
        return cls(name=name, block_hashes=hashes, trace_block_size=trace_block_size)

    @property
    def requests(self) -> int:
        return len(self.block_hashes)

    @property
    def block_accesses(self) -> int:
        return sum(len(h) for h in self.block_hashes)

    @property
    def unique_blocks(self) -> int:
        return len({h for hashes in self.block_hashes for h in hashes})


# --------------------------------------------------------------------------- capacity

#: the largest capacity :func:`parse_capacity` gives: block ids are int64
#: (a spec's ``block_ids``), so no backend holds more blocks
_MAX_CAPACITY = 2**63 - 1

_BLOCKS = re.compile(r"[0-9]+")
_PERCENT = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def parse_capacity(spec: str, unique_blocks: int) -> int:
    """Capacity in blocks from ``"1000"`` (blocks) or ``"5%"`` (floor of that
    share of ``unique_blocks``, the trace's distinct blocks).

    Raises :class:`ConfigError` for zero, negative, above 100% or above
    2**63 - 1 blocks (block ids are int64), a percentage that rounds down to
    no block, or anything else that is not one of the two forms (ASCII
    digits only, as many as given: ``int()``'s 4300-digit limit does not
    apply).
    """
    text = spec.strip()
    quoted = abridged(spec)
    if text.startswith("-"):
        raise ConfigError(f"capacity {quoted} must be positive")
    if text.endswith("%"):
        number = text[:-1].strip()
        if not _PERCENT.fullmatch(number):
            raise ConfigError(f"capacity {quoted} is not a percentage like '5%' or '2.5%'")
        # through Decimal: Fraction(str) stops at int()'s 4300 digits
        percent = Fraction(Decimal(number))
        if percent <= 0:
            raise ConfigError(f"capacity {quoted} must be more than 0%")
        if percent > 100:
            raise ConfigError(f"capacity {quoted} must be at most 100%")
        # Fraction keeps "5% of 182790" exact: 9139, not 9139.499999
        blocks = math.floor(percent * unique_blocks / 100)
        if blocks < 1:
            raise ConfigError(
                f"capacity {quoted} of {unique_blocks} unique blocks is less than one block"
            )
        return blocks
    if not _BLOCKS.fullmatch(text):
        raise ConfigError(
            f"capacity {quoted} is neither a block count like '1000' nor a percentage like '5%'"
        )
    digits = text.lstrip("0")
    if not digits:
        raise ConfigError(f"capacity {quoted} must be at least 1 block")
    # the length first: int() refuses more than 4300 digits
    if len(digits) > len(str(_MAX_CAPACITY)) or int(digits) > _MAX_CAPACITY:
        raise ConfigError(f"capacity {quoted} must be at most {_MAX_CAPACITY} blocks (2**63 - 1)")
    return int(digits)


# --------------------------------------------------------------------------- replay


class ReplayError(KVOffloadError, RuntimeError):
    """A manager call raised while :func:`replay` served a request: the
    policy's own code, or the manager refusing what the policy did
    (:class:`~kvoffload.errors.PolicyContractError`). The exception raised
    is the ``__cause__``; the message names the policy, the trace, the
    capacity and the request (its 0-based index in the trace, as a trace's
    request ids), then the exception's type and message."""

    def __init__(
        self, *, policy: str, trace: str, capacity: int, request: int, error: Exception
    ) -> None:
        self.policy = policy
        self.trace = trace
        self.capacity = capacity
        self.request = request
        super().__init__(
            f"policy {policy!r} failed on trace {trace} (capacity {capacity} blocks) at request "
            f"{request}: {described(error)}"
        )


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one replay of a trace against one manager measured."""

    trace: str
    policy: str
    capacity: int
    requests: int
    block_accesses: int
    hit_blocks: int
    evictions: int
    rejected_stores: int
    #: hashes passed to touch + lookup + prepare_store + complete_store
    #: (hinted hashes not counted)
    block_ops: int
    #: time spent inside the manager calls only (hint and unhint included)
    wall_seconds: float
    #: requests hinted ahead of the one being served
    lookahead: int = 0
    #: each request's hits, in trace order (as :class:`BeladyResult`'s)
    request_hits: tuple[int, ...] = field(default=(), repr=False)

    @property
    def prefix_hit_ratio(self) -> float:
        """Hit blocks / block accesses (0.0 for an empty trace)."""
        return self.hit_blocks / self.block_accesses if self.block_accesses else 0.0

    @property
    def block_ops_per_second(self) -> float:
        """Manager throughput (0.0 if nothing was timed)."""
        return self.block_ops / self.wall_seconds if self.wall_seconds > 0 else 0.0


def replay(
    trace: ReplayTrace,
    *,
    policy: str,
    capacity: int,
    manager: OffloadingManager | None = None,
    progress: Callable[[int], object] | None = None,
    lookahead: int = 0,
) -> ReplayResult:
    """Replay ``trace`` against a fresh manager of ``capacity`` blocks.

    The manager is a :class:`~kvoffload.manager.PolicyOffloadingManager`
    running ``policy`` over a :class:`~kvoffload.backends.cpu.CPUBackend`,
    unless ``manager`` is given: it is then used as is (empty, of that
    capacity, its hint window empty) and ``policy`` / ``capacity`` only
    label the result. ``lookahead`` requests are hinted ahead of the one
    being served (see the module doc); it needs a manager that takes hints
    (:class:`~kvoffload.abstract.SupportsHints`). ``progress(n)`` is told
    every few hundred requests how many were done since its last call
    (outside the timed section).

    Raises :class:`ConfigError` for a ``capacity`` that is not a whole
    number of blocks >= 1 or a bad ``lookahead``, and :class:`ReplayError`
    when a manager call raises while a request is served.
    """
    if not is_int(capacity) or capacity < 1:
        raise ConfigError(f"capacity must be a whole number of blocks >= 1, got {capacity!r}")
    if type(lookahead) is not int or lookahead < 0:
        raise ConfigError(f"lookahead must be a whole number of requests >= 0, got {lookahead!r}")
    if manager is None:
        # imported here: the manager pulls in the policy registry, which a
        # caller that only wants Belady or capacity parsing does not need
        from kvoffload.manager import PolicyOffloadingManager

        manager = PolicyOffloadingManager(
            CPUBackend(block_size=trace.trace_block_size, num_blocks=capacity), policy=policy
        )
    touch = manager.touch
    lookup = manager.lookup
    prepare_store = manager.prepare_store
    complete_store = manager.complete_store
    clock = time.perf_counter
    requests = trace.block_hashes
    window: deque[int] = deque()  # tickets of the requests hinted, in order
    elapsed = 0.0
    if lookahead:
        if not isinstance(manager, SupportsHints):
            raise ConfigError(
                f"lookahead needs a manager that takes hints; {type(manager).__name__} does not"
            )
        hint, unhint = manager.hint, manager.unhint
        start = clock()
        window.extend(hint(r) for r in requests[:lookahead])
        elapsed += clock() - start

    accesses = hits = evictions = rejected = block_ops = 0
    request_hits = []
    done = 0
    for i, hashes in enumerate(requests):
        n = len(hashes)
        # a list, so the manager need not copy an iterable it walks twice
        request = list(hashes)
        start = clock()
        try:  # free in 3.11 until something raises
            if window:
                if i + lookahead < len(requests):
                    window.append(hint(requests[i + lookahead]))
                unhint(window.popleft())  # request i is served now
            touch(request)
            hit = lookup(request)
            missing = request[hit:]
            stored = prepare_store(missing)
            if stored is not None:
                complete_store(stored.block_hashes_to_store)
        except Exception as exc:  # any failure of a policy's code, one's own included
            raise ReplayError(
                policy=policy, trace=trace.name, capacity=capacity, request=i, error=exc
            ) from exc
        elapsed += clock() - start

        accesses += n
        hits += hit
        request_hits.append(hit)
        block_ops += 2 * n + len(missing)
        if stored is None:
            rejected += 1
        else:
            evictions += len(stored.block_hashes_evicted)
            block_ops += len(stored.block_hashes_to_store)
        done += 1
        if progress is not None and done == PROGRESS_EVERY:
            progress(done)
            done = 0
    if progress is not None and done:
        progress(done)
    return ReplayResult(
        trace=trace.name,
        policy=policy,
        capacity=capacity,
        requests=trace.requests,
        block_accesses=accesses,
        hit_blocks=hits,
        evictions=evictions,
        rejected_stores=rejected,
        block_ops=block_ops,
        wall_seconds=elapsed,
        lookahead=lookahead,
        request_hits=tuple(request_hits),
    )


# --------------------------------------------------------------------------- Belady


@dataclass(frozen=True, slots=True)
class BeladyResult:
    """Hits of the clairvoyant policy at one capacity."""

    capacity: int
    requests: int
    block_accesses: int
    hit_blocks: int
    evictions: int
    #: each request's hits, in trace order (to compare a policy request by request)
    request_hits: tuple[int, ...] = field(default=(), repr=False)
    #: whether stores could be declined (:func:`belady`'s ``bypass``)
    bypass: bool = False
    #: missed blocks not stored (with ``bypass``; 0 without)
    declined_blocks: int = 0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.hit_blocks / self.block_accesses if self.block_accesses else 0.0


def belady(
    requests: Sequence[Sequence[K]],
    capacity: int,
    *,
    bypass: bool = False,
    progress: Callable[[int], object] | None = None,
) -> BeladyResult:
    """Belady's optimal (future-knowing) replacement under prefix semantics.

    Per request: its hits are the longest prefix of its blocks that is
    resident; then its non-resident blocks are inserted in order, each
    evicting the resident block whose next use is furthest away (blocks never
    used again first; among blocks next used by the same request, the later
    position first, since a prefix hit cannot reach it without the earlier
    ones). The request's own blocks are never evicted for it; when only they
    are left, the rest of the request is not inserted.

    Without ``bypass`` every missed block that can be stored is: the bound
    for policies that store what they miss, as the replay's do without
    hints. With ``bypass`` the block to be stored is a candidate too: when
    the cache is full and it is next used after every block it could evict,
    it is not stored, nor is the rest of its request (a later block of a
    chain is used only with it). That is the bound to hold a policy to when
    it may decline stores (``hkvarc`` with hints does), which the first can
    be well below (the synthetic trace at 1%: 0.1593, against 0.1854 with
    bypass and hkvarc's 0.1668 with 128 requests hinted).

    Next uses are precomputed backwards; victims come from a max-heap keyed by
    next use with lazy invalidation (an entry is live only while its key is
    the block's current key), so the whole run is O(accesses log accesses).
    Raises :class:`~kvoffload.errors.ConfigError` for a capacity that is not
    a whole number of blocks >= 1 (``nan``, ``inf``, ``2.5`` and ``True``
    once ran, as an unbounded cache or as 3 or 1 blocks).
    """
    if not is_int(capacity) or capacity < 1:
        raise ConfigError(f"capacity must be a whole number of blocks >= 1, got {capacity!r}")
    n_requests = len(requests)
    # key of a use = request index * stride + position, larger = further away
    stride = max((len(r) for r in requests), default=0) + 1
    never = n_requests * stride

    # next_keys[i][p]: key of the next use, after request i, of requests[i][p]
    next_keys: list[list[int]] = [[]] * n_requests
    last_use: dict[K, int] = {}
    for i in range(n_requests - 1, -1, -1):
        blocks = requests[i]
        next_keys[i] = [last_use.get(b, never) for b in blocks]
        base = i * stride
        # backwards, so a block repeated within the request keeps its first position
        for p in range(len(blocks) - 1, -1, -1):
            last_use[blocks[p]] = base + p
    del last_use

    resident: dict[K, int] = {}  # block -> key of its next use
    heap: list[tuple[int, int, K]] = []  # (-key, insertion counter, block)
    counter = 0
    hits = evictions = accesses = declined = 0
    request_hits = []
    done = 0
    for i, blocks in enumerate(requests):
        accesses += len(blocks)
        hit = 0
        for b in blocks:
            if b not in resident:
                break
            hit += 1
        hits += hit
        request_hits.append(hit)
        # Every other resident block is next used after request i, so its key
        # is >= this bound; keys below it belong to this request (protected).
        current_bound = (i + 1) * stride
        keys = next_keys[i]
        for p, b in enumerate(blocks):
            if b in resident:
                continue
            if len(resident) >= capacity:
                victim = _furthest(heap, resident, current_bound)
                if victim is None:
                    break  # only this request's blocks are left
                if bypass and keys[p] > resident[victim]:
                    # used after every block it could evict: not stored,
                    # nor the rest of the request
                    declined += len({x for x in blocks[p:] if x not in resident})
                    break
                heapq.heappop(heap)
                del resident[victim]
                evictions += 1
            # Not pushed: inserted blocks are protected until the request ends.
            resident[b] = i * stride + p
        for p, b in enumerate(blocks):
            if b in resident:
                key = keys[p]
                resident[b] = key
                heapq.heappush(heap, (-key, counter, b))
                counter += 1
        done += 1
        if progress is not None and done == PROGRESS_EVERY:
            progress(done)
            done = 0
    if progress is not None and done:
        progress(done)
    return BeladyResult(
        capacity=capacity,
        requests=n_requests,
        block_accesses=accesses,
        hit_blocks=hits,
        evictions=evictions,
        request_hits=tuple(request_hits),
        bypass=bypass,
        declined_blocks=declined,
    )


def _furthest(
    heap: list[tuple[int, int, K]], resident: dict[K, int], current_bound: int
) -> K | None:
    """The resident block with the furthest next use, its entry left at the
    top of the heap (stale entries above it are dropped); ``None`` when there
    is none or it belongs to the current request."""
    while heap:
        neg_key, _, block = heap[0]
        if resident.get(block) != -neg_key:
            heapq.heappop(heap)  # stale: evicted, or its key moved on
            continue
        return None if -neg_key < current_bound else block
    return None
