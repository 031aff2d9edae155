"""Workloads: streams of requests that name the KV blocks they need.

A :class:`Request` lists its prompt's blocks as *trace block ids*: integers
that each name a chained prefix block of ``trace_block_size`` tokens (the
block and every token before it), as in the Mooncake traces. Two sources
produce them: :mod:`kvoffload.runtime.trace` (JSONL trace files) and
:mod:`kvoffload.runtime.synthetic` (a seeded generator).

This module holds what both share: the request type, the :class:`Workload`
base class, the mapping from trace blocks to an engine's block hashes, and
the helpers that decide *when* requests are issued (:func:`paced`,
:func:`loop`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvoffload.abstract import BlockHash
from kvoffload.errors import KVOffloadError

__all__ = [
    "LoopedWorkload",
    "Pacer",
    "Request",
    "Workload",
    "WorkloadError",
    "engine_block_hashes",
    "loop",
    "paced",
]


class WorkloadError(KVOffloadError, ValueError):
    """A workload cannot be read or built: a missing or malformed trace file, or
    generator parameters out of range. The message names the file, line and
    field where that applies."""


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt of a workload.

    ``block_ids`` are chained trace block ids at the workload's trace block
    size: equal ids at the same position mean an equal prefix up to and
    including that block. The last block may be partial
    (``len(block_ids) == ceil(input_length / trace_block_size)`` for traces).
    """

    request_id: int
    #: seconds since the start of the workload
    arrival_time: float
    block_ids: tuple[int, ...]
    input_length: int
    output_length: int
    #: where the request came from: ``"trace"``, or the synthetic kind
    #: (``"chat"``, ``"document"``, ``"one_off"``); low-cardinality, fit for a label
    kind: str = "trace"


class Workload(ABC):
    """A re-iterable stream of requests in arrival order.

    Each ``iter()`` starts again from the first request and yields the same
    sequence. A workload may be endless (``len_hint`` is then ``None``).
    """

    #: tokens per trace block id
    trace_block_size: int

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """A fresh pass over the requests, in non-decreasing arrival time."""

    @abstractmethod
    def describe(self) -> str:
        """One human-readable line about the workload (shown by the admin API)."""

    @property
    def len_hint(self) -> int | None:
        """Number of requests in one pass, ``None`` when endless or unknown."""
        return None


# --------------------------------------------------------------------------- block mapping

_ID = struct.Struct("<QI")
_SIZES = struct.Struct("<QQ")


def _digest(data: bytes) -> BlockHash:
    return BlockHash(hashlib.blake2b(data, digest_size=16).digest())


def engine_block_hashes(
    block_ids: Sequence[int],
    *,
    trace_block_size: int,
    engine_block_size: int,
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """Chained engine block hashes for a request's trace blocks.

    ``engine_block_size`` must divide ``trace_block_size`` or be a multiple of
    it. Each hash is blake2b over the parent hash and what the engine block
    covers, so a shared prefix of trace ids gives a shared prefix of hashes
    and the chains diverge for good at the first differing id:

    - engine block B divides trace block T: every trace id expands into T/B
      engine blocks, hashed from ``(parent, id, sub_index)``;
    - T divides B: every B/T consecutive ids make one engine block, hashed from
      ``(parent, ids...)``; trailing ids that do not fill a block are dropped.

    Engines only hash *full* blocks: with ``num_tokens`` (the prompt length)
    the result is cut to ``num_tokens // engine_block_size`` hashes, so the
    partial tail of the last trace block is not offloaded. Without it every
    trace block counts as full.

    Raises :class:`WorkloadError` for a block size that is not positive and
    below 2**64 tokens, or sizes that do not divide one another.
    """
    # the chain's root packs both sizes as unsigned 64-bit integers
    if not (0 < trace_block_size < 2**64 and 0 < engine_block_size < 2**64):
        raise WorkloadError(
            f"block sizes must be positive and below 2**64 tokens, got trace {trace_block_size}, "
            f"engine {engine_block_size}"
        )
    full = len(block_ids) * trace_block_size // engine_block_size
    if num_tokens is not None:
        full = min(full, num_tokens // engine_block_size)
    out: list[BlockHash] = []
    # The chain's root digests the two block sizes: hashes of different
    # geometries never collide, and every parent is a 16-byte digest, so the
    # packed input of each hash has a fixed layout and cannot be ambiguous.
    parent = _digest(_SIZES.pack(trace_block_size, engine_block_size))
    if trace_block_size % engine_block_size == 0:
        per_id = trace_block_size // engine_block_size
        pack = _ID.pack
        for n in range(full):
            block_id, sub = divmod(n, per_id)
            parent = _digest(parent + pack(block_ids[block_id], sub))
            out.append(parent)
    elif engine_block_size % trace_block_size == 0:
        per_block = engine_block_size // trace_block_size
        group = struct.Struct(f"<{per_block}Q")
        for n in range(full):
            ids = block_ids[n * per_block : (n + 1) * per_block]
            parent = _digest(parent + group.pack(*ids))
            out.append(parent)
    else:
        raise WorkloadError(
            f"engine block size {engine_block_size} and trace block size "
            f"{trace_block_size} must divide one another"
        )
    return out


# --------------------------------------------------------------------------- pacing


class Pacer:
    """Decides when each request is due.

    ``speed=None`` (or ``inf``) issues requests as fast as possible. Otherwise
    a request arriving ``t`` seconds after the first one is due
    ``t / speed`` seconds after the pacer saw that first request, by
    ``clock`` (so ``speed=2.0`` replays twice as fast as real time). Clock and
    sleep are injectable so tests never sleep.
    """

    def __init__(
        self,
        speed: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speed is not None and not (speed > 0):  # also rejects NaN
            raise WorkloadError(f"speed must be > 0 (or None for as fast as possible), got {speed}")
        self.speed = None if speed is None or math.isinf(speed) else speed
        self._clock = clock
        self._anchor: tuple[float, float] | None = None  # (clock at start, first arrival)
        self._paused_at: float | None = None

    def due_at(self, request: Request) -> float:
        """The clock time at which ``request`` is due. The first call anchors the
        pacer: its request is due at once. While paused nothing is due."""
        if self._paused_at is not None:
            return math.inf
        if self._anchor is None:
            self._anchor = (self._clock(), request.arrival_time)
        start, first_arrival = self._anchor
        if self.speed is None:
            return start
        return start + (request.arrival_time - first_arrival) / self.speed

    def pause(self) -> None:
        """Stop the trace's time (again: no change) until :meth:`resume`."""
        if self._paused_at is None:
            self._paused_at = self._clock()

    def resume(self) -> None:
        """Let the trace's time run on from where :meth:`pause` stopped it:
        every request comes as much later as the pause lasted."""
        if self._paused_at is None:
            return
        if self._anchor is not None:
            start, first_arrival = self._anchor
            self._anchor = (start + self._clock() - self._paused_at, first_arrival)
        self._paused_at = None

    def delay(self, request: Request) -> float:
        """Seconds to wait before issuing ``request`` (0.0 when it is due)."""
        return max(0.0, self.due_at(request) - self._clock())


def paced(
    requests: Iterable[Request],
    speed: float | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> Iterator[Request]:
    """Yield ``requests`` no earlier than their arrival times allow (see :class:`Pacer`).

    Lateness is not made up by skipping: a slow consumer just gets the
    requests that are overdue back to back.
    """
    pacer = Pacer(speed, clock=clock)
    for request in requests:
        wait = pacer.delay(request)
        if wait > 0:
            sleep(wait)
        yield request


# --------------------------------------------------------------------------- looping


class LoopedWorkload(Workload):
    """A finite workload repeated endlessly; see :func:`loop`."""

    def __init__(self, inner: Workload) -> None:
        self.inner = inner
        self.trace_block_size = inner.trace_block_size

    def __iter__(self) -> Iterator[Request]:
        return _repeat(self.inner)

    def describe(self) -> str:
        return f"{self.inner.describe()}, looped endlessly"


def loop(workload: Workload) -> LoopedWorkload:
    """Repeat a finite workload endlessly.

    Block ids stay the same in every pass (the repeat *is* the reuse). Request
    ids are shifted by ``max id + 1`` per pass so they stay unique, and times
    by the first pass's span plus its mean gap between arrivals so the passes
    follow one another at the workload's own rate. Iteration stops if a pass
    is empty rather than spin.
    """
    return LoopedWorkload(workload)


def _repeat(workload: Iterable[Request]) -> Iterator[Request]:
    first: Request | None = None
    last: Request | None = None
    count = 0
    max_id = -1
    for request in workload:
        if first is None:
            first = request
        last = request
        count += 1
        max_id = max(max_id, request.request_id)
        yield request
    if first is None or last is None:
        return
    span = last.arrival_time - first.arrival_time
    period = span + (span / (count - 1) if count > 1 else 0.0)
    id_stride = max_id + 1
    for n in itertools.count(1):
        empty = True
        for request in workload:
            empty = False
            yield replace(
                request,
                request_id=request.request_id + n * id_stride,
                arrival_time=request.arrival_time + n * period,
            )
        if empty:
            return
