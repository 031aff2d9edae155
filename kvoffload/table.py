"""The block table: every resident block and ghost of a manager, in lists.

See ``docs/block-table.md`` for the model and the exact behaviour of every
method. :data:`BlockTable` is the C implementation
(``kvoffload._table``) when it was built, else :class:`PyBlockTable`, the
pure-Python reference it is tested against; ``KVOFFLOAD_PURE_PYTHON=1``
forces the reference.
"""

from __future__ import annotations

import heapq
import math
import os
import warnings
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvoffload.abstract import BlockHash
from kvoffload.errors import UnknownTicketError

#: resident tags are 0..3, ghost tags 4..7
RESIDENT_TAGS = 4
TAGS = 8
#: ``tag_of`` for a hash without an entry
NO_TAG = -1
#: a :attr:`TouchRules.in_flight` destination: the block stays where it is
STAY = -1
#: the key of a hinted use is ``ticket * USE_STRIDE + position`` (positions
#: past ``USE_STRIDE - 1`` count as ``USE_STRIDE - 1``): later uses, larger keys
USE_STRIDE = 1 << 24
#: tickets stop short of this, so that every key fits in 63 bits
_MAX_TICKET = 1 << 39

#: keys are any hashable object at run time; typed as the block hashes they are
Key = BlockHash
Handle = Any


def _is_tag(tag: object, low: int, high: int) -> bool:
    """An int (an ``IntEnum`` member too, not a bool) in ``low..high-1``."""
    return isinstance(tag, int) and not isinstance(tag, bool) and low <= tag < high


def _resident_tag(tag: int) -> int:
    if not _is_tag(tag, 0, RESIDENT_TAGS):
        raise ValueError(f"resident tag must be 0..{RESIDENT_TAGS - 1}, got {tag!r}")
    return int(tag)


def _ghost_tag(tag: int) -> int:
    if not _is_tag(tag, RESIDENT_TAGS, TAGS):
        raise ValueError(f"ghost tag must be {RESIDENT_TAGS}..{TAGS - 1}, got {tag!r}")
    return int(tag)


def _any_tag(tag: int) -> int:
    if not _is_tag(tag, 0, TAGS):
        raise ValueError(f"tag must be 0..{TAGS - 1}, got {tag!r}")
    return int(tag)


@dataclass(frozen=True, slots=True)
class TouchRules:
    """What a block table's ``touch`` does to each block it finds, by the
    resident list (tag ``0..3``) the block is in. A list a mapping does not
    name keeps its blocks: each moves to its own list's most recent end
    (LRU within the list). The default, ``TouchRules()``, is that for every
    list and leaves ghosts alone.

    ``TouchRules(ready={T1: T2}, ghosts=True)`` is ARC's: a ready T1 block
    used again moves to T2, a block whose store is in flight moves to its
    own list's recent end, and a touch reports the ghosts it meets."""

    #: a ready block (idle or pinned by loads) of list ``k`` moves to the most
    #: recent end of list ``ready[k]``
    ready: Mapping[int, int] = field(default_factory=dict)
    #: a block whose store is in flight, of list ``k``: to the most recent end
    #: of ``in_flight[k]``, or nowhere if that is :data:`STAY`
    in_flight: Mapping[int, int] = field(default_factory=dict)
    #: a touched ghost moves to its ghost list's most recent end, and
    #: ``touch`` returns the ghost lists it hit
    ghosts: bool = False

    def __post_init__(self) -> None:
        for name, rules, low in (("ready", self.ready, 0), ("in_flight", self.in_flight, STAY)):
            for src, dest in rules.items():
                if not (_is_tag(src, 0, RESIDENT_TAGS) and _is_tag(dest, low, RESIDENT_TAGS)):
                    allowed = "a resident list or STAY" if low < 0 else "a resident list"
                    raise ValueError(
                        f"TouchRules.{name} maps resident lists (0..3) to {allowed}; "
                        f"got {src!r}: {dest!r}"
                    )
            object.__setattr__(self, name, MappingProxyType(dict(rules)))

    def moves(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where a ready and where an in-flight block of each list goes."""
        return (
            tuple(self.ready.get(t, t) for t in range(RESIDENT_TAGS)),
            tuple(self.in_flight.get(t, t) for t in range(RESIDENT_TAGS)),
        )


_DEFAULT_MOVES = TouchRules().moves()


class PyBlockTable:
    """The pure-Python block table (see ``docs/block-table.md``)."""

    def __init__(self) -> None:
        #: every entry's tag: resident 0..3, ghost 4..7
        self._tag: dict[Key, int] = {}
        #: per resident tag: the entries in line (hash -> handle), oldest first
        self._main: list[OrderedDict[Key, Handle]] = [OrderedDict() for _ in range(RESIDENT_TAGS)]
        #: per resident tag: the entries set aside (hash -> (stamp, handle)),
        #: older than every entry in line, in stamp order among themselves
        self._aside: list[dict[Key, tuple[int, Handle]]] = [{} for _ in range(RESIDENT_TAGS)]
        #: per resident tag: a heap of (stamp, hash) holding every ready entry
        #: set aside; pairs that no longer say so are dropped when popped
        self._heap: list[list[tuple[int, Key]]] = [[] for _ in range(RESIDENT_TAGS)]
        #: per resident tag: the stamp each hash has a pair in the heap for
        self._queued: list[dict[Key, int]] = [{} for _ in range(RESIDENT_TAGS)]
        #: per resident tag: how many entries set aside are ready
        self._aside_ready = [0] * RESIDENT_TAGS
        #: per ghost tag: the order of ghosts
        self._ghosts: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(RESIDENT_TAGS)]
        #: reference counts that are not 0
        self._refs: dict[Key, int] = {}
        #: the next stamps: later than every one given (evictions), earlier (move to front)
        self._late = 0
        self._early = -1
        self._resident = 0
        self.pinned = 0
        self.in_flight = 0
        self.walked = 0
        #: per resident tag: victims taken from its order, and held ones
        self._evicted = [[0, 0] for _ in range(RESIDENT_TAGS)]
        self._ready_to, self._in_flight_to = _DEFAULT_MOVES
        self._touch_ghosts = False
        # -- the hint window
        #: per hinted hash: the keys of its uses in the window, ascending. A
        #: hash here without a ``_tag`` entry is a hint-only entry
        self._uses: dict[Key, list[int]] = {}
        #: per ticket in the window: its hashes
        self._tickets: dict[int, list[Key]] = {}
        self._next_ticket = 1
        self.window_uses = 0
        self.window_resident = 0
        self.holds = 0
        self.window_found = 0
        #: hint order: hinted resident entries are held out of their tag's order
        self._hold = False
        #: per resident tag: the held entries (hash -> handle)
        self._held: list[dict[Key, Handle]] = [{} for _ in range(RESIDENT_TAGS)]
        self._held_ready = [0] * RESIDENT_TAGS
        #: (-key of the next use, hash) of every ready held entry; pairs that
        #: no longer say so are dropped when popped
        self._hheap: list[tuple[int, Key]] = []
        #: the key each hash has a pair in ``_hheap`` for
        self._hqueued: dict[Key, int] = {}

    @property
    def window_requests(self) -> int:
        return len(self._tickets)

    @property
    def window_keys(self) -> int:
        return len(self._uses)

    # -- reading ----------------------------------------------------------

    def __len__(self) -> int:
        return self._resident

    def __contains__(self, h: object) -> bool:
        return self._tag.get(h, TAGS) < RESIDENT_TAGS  # type: ignore[call-overload,no-any-return]

    def _handle(self, h: Key, tag: int) -> Handle:
        main = self._main[tag]
        if h in main:
            return main[h]
        held = self._held[tag]
        return held[h] if h in held else self._aside[tag][h][1]

    def get(self, h: Key, /) -> Handle:
        tag = self._tag.get(h, TAGS)
        return self._handle(h, tag) if tag < RESIDENT_TAGS else None

    def ref(self, h: Key, /) -> int | None:
        if self._tag.get(h, TAGS) >= RESIDENT_TAGS:
            return None
        return self._refs.get(h, 0)

    def tag_of(self, h: Key, /) -> int:
        return self._tag.get(h, NO_TAG)

    def tags(self, hashes: Iterable[Key], /) -> list[int]:
        get = self._tag.get
        return [get(h, NO_TAG) for h in hashes]

    def size(self, tag: int, /) -> int:
        tag = _any_tag(tag)
        if tag < RESIDENT_TAGS:
            return len(self._main[tag]) + len(self._aside[tag]) + len(self._held[tag])
        return len(self._ghosts[tag - RESIDENT_TAGS])

    def held(self, tag: int, /) -> int:
        return len(self._held[_resident_tag(tag)])

    @property
    def held_ready(self) -> int:
        return sum(self._held_ready)

    def evicted(self, tag: int, held: bool = False) -> int:
        return self._evicted[_resident_tag(tag)][bool(held)]

    def lookup(self, hashes: Iterable[Key], /) -> int:
        tag, refs = self._tag, self._refs
        n = 0
        for h in hashes:
            if tag.get(h, TAGS) >= RESIDENT_TAGS or refs.get(h, 0) < 0:
                break
            n += 1
        return n

    def absent(self, hashes: Iterable[Key], /) -> list[Key]:
        get = self._tag.get
        return [h for h in hashes if get(h, TAGS) >= RESIDENT_TAGS]

    def items(self, tag: int, /) -> list[tuple[Key, Handle]]:
        tag = _any_tag(tag)
        if tag >= RESIDENT_TAGS:
            return list(self._ghosts[tag - RESIDENT_TAGS].items())
        aside = sorted(self._aside[tag].items(), key=lambda item: item[1][0])
        uses = self._uses
        held = sorted(self._held[tag].items(), key=lambda item: -uses[item[0]][0])
        return [(h, handle) for h, (_, handle) in aside] + list(self._main[tag].items()) + held

    def keys(self, tag: int, /) -> list[Key]:
        return [h for h, _ in self.items(tag)]

    def memory_bytes(self) -> int:
        """Not measured for the reference (its dicts belong to Python)."""
        return 0

    # -- checks -------------------------------------------------------------

    def _resident_list(self, hashes: Iterable[Key]) -> list[Key]:
        """``hashes`` as a list; ``KeyError(h)`` for the first one that is
        not resident."""
        hashes = list(hashes)
        get = self._tag.get
        for h in hashes:
            if get(h, TAGS) >= RESIDENT_TAGS:
                raise KeyError(h)
        return hashes

    # -- entries set aside ----------------------------------------------------

    def _set_aside(self, h: Key, tag: int, handle: Handle, stamp: int) -> None:
        self._aside[tag][h] = (stamp, handle)
        if not self._refs.get(h, 0):
            self._aside_ready[tag] += 1
            self._queue(tag, h, stamp)

    def _queue(self, tag: int, h: Key, stamp: int) -> None:
        """Make sure the heap of ``tag`` holds ``(stamp, h)``."""
        queued = self._queued[tag]
        if queued.get(h) == stamp:
            return
        heap = self._heap[tag]
        if len(heap) > 2 * len(self._aside[tag]) + 32:  # mostly stale pairs: rebuild
            refs = self._refs
            ready = {k: s for k, (s, _) in self._aside[tag].items() if not refs.get(k, 0)}
            heap[:] = [(s, k) for k, s in ready.items() if k != h]
            heapq.heapify(heap)
            queued.clear()
            queued.update(ready)
        heapq.heappush(heap, (stamp, h))
        queued[h] = stamp

    def _ready_again(self, h: Key) -> None:
        """``h`` became ready (its last load completed, or its store)."""
        tag = self._tag[h]
        entry = self._aside[tag].get(h)
        if entry is not None:
            self._aside_ready[tag] += 1
            self._queue(tag, h, entry[0])
        elif h in self._held[tag]:
            self._held_ready[tag] += 1
            self._hqueue(h)

    def _busy_again(self, h: Key, tag: int) -> None:
        """``h``, ready, is pinned (its heap pair goes stale)."""
        if h in self._aside[tag]:
            self._aside_ready[tag] -= 1
        elif h in self._held[tag]:
            self._held_ready[tag] -= 1

    def _detach(self, h: Key, tag: int) -> Handle:
        """Take ``h`` out of the order of ``tag`` (its heap pair goes stale)."""
        main = self._main[tag]
        if h in main:
            return main.pop(h)
        ready = not self._refs.get(h, 0)
        held = self._held[tag]
        if h in held:
            self._held_ready[tag] -= ready
            return held.pop(h)
        _, handle = self._aside[tag].pop(h)
        self._aside_ready[tag] -= ready
        return handle

    def _retag(self, h: Key, tag: int, dest: int) -> None:
        """The held entry ``h`` of ``tag`` is of tag ``dest`` now (same place)."""
        self._held[dest][h] = self._held[tag].pop(h)
        if not self._refs.get(h, 0):
            self._held_ready[tag] -= 1
            self._held_ready[dest] += 1
        self._tag[h] = dest

    # -- the hint window ------------------------------------------------------

    def _hqueue(self, h: Key) -> None:
        """Make sure the held heap has the pair of the ready held entry ``h``."""
        key = self._uses[h][0]
        queued = self._hqueued
        if queued.get(h) == key:
            return
        heap = self._hheap
        if len(heap) > 2 * sum(self._held_ready) + 32:  # mostly stale pairs: rebuild
            refs, uses = self._refs, self._uses
            queued.clear()
            # (an unhint calls this midway: a held entry whose last use it
            # took has none left, and is released later in that call)
            queued.update(
                (k, uses[k][0])
                for held in self._held
                for k in held
                if not refs.get(k, 0) and uses[k]
            )
            queued.pop(h, None)
            heap[:] = [(-key_, k) for k, key_ in queued.items()]
            heapq.heapify(heap)
        heapq.heappush(heap, (-key, h))
        queued[h] = key

    def _ready_held(self, taken: list[Key]) -> Iterator[tuple[Key, int, Handle]]:
        """The ready held entries (hash, tag, handle), farthest next use first,
        popped from the held heap; each popped hash is appended to ``taken``
        (to be queued again unless its entry leaves)."""
        heap, queued, refs, tags = self._hheap, self._hqueued, self._refs, self._tag
        while heap:
            neg, h = heapq.heappop(heap)
            if queued.get(h) != -neg:
                continue  # superseded by a later pair
            del queued[h]
            tag = tags.get(h, TAGS)
            if tag >= RESIDENT_TAGS or h not in self._held[tag] or refs.get(h, 0):
                continue  # no longer held and ready: queued again when it is
            taken.append(h)
            yield h, tag, self._held[tag][h]

    def _hold_entry(self, h: Key, tag: int) -> None:
        self._held[tag][h] = self._detach(h, tag)
        self.holds += 1
        if not self._refs.get(h, 0):
            self._held_ready[tag] += 1
            self._hqueue(h)

    def hint(self, hashes: Iterable[Key], /) -> int:
        hashes = list(hashes)
        uses, tags = self._uses, self._tag
        for h in hashes:
            # a key whose hash or __eq__ raises changes nothing
            uses.get(h)
            tags.get(h)
        ticket = self._next_ticket
        if ticket >= _MAX_TICKET:
            raise OverflowError("a BlockTable hands out fewer than 2**39 hint tickets")
        self._next_ticket += 1
        self._tickets[ticket] = hashes
        base = ticket * USE_STRIDE
        for p, h in enumerate(hashes):
            key = base + min(p, USE_STRIDE - 1)
            mine = uses.get(h)
            if mine is not None:
                mine.append(key)
                continue
            uses[h] = [key]
            tag = tags.get(h, TAGS)
            if tag < RESIDENT_TAGS:
                self.window_resident += 1
                if self._hold:
                    self._hold_entry(h, tag)
        self.window_uses += len(hashes)
        return ticket

    def unhint(self, ticket: int, /) -> None:
        if type(ticket) is not int or ticket not in self._tickets:
            raise UnknownTicketError(
                f"hint ticket {ticket!r} is not in the window: it was never returned by this "
                "manager's hint(), or was already unhinted"
            )
        hashes = self._tickets.pop(ticket)
        self.window_found += self.lookup(hashes)
        uses, tags = self._uses, self._tag
        base = ticket * USE_STRIDE
        for p, h in enumerate(hashes):
            uses[h].remove(base + min(p, USE_STRIDE - 1))
        self.window_uses -= len(hashes)
        # last to first: the held entries that rejoin their lists end with
        # the first hash most recent, as a touch leaves them
        for h in reversed(hashes):
            mine = uses.get(h)
            if mine is None:
                continue  # done at a later position
            tag = tags.get(h, TAGS)
            held = tag < RESIDENT_TAGS and h in self._held[tag]
            if mine:
                if held and not self._refs.get(h, 0):
                    self._hqueue(h)  # its next use moved on
                continue
            del uses[h]
            if tag < RESIDENT_TAGS:
                self.window_resident -= 1
                if held:
                    self._main[tag][h] = self._detach(h, tag)

    def next_uses(self, hashes: Iterable[Key], /) -> list[int]:
        get = self._uses.get
        return [mine[0] if (mine := get(h)) else -1 for h in hashes]

    def farthest(self, protected: Container[Key], n: int, /) -> list[int]:
        if type(n) is not int:
            raise TypeError(f"n must be an int, got {n!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n!r}")
        taken: list[Key] = []
        found: list[int] = []
        try:
            for h, _, _ in self._ready_held(taken):
                if len(found) >= n:
                    break
                if h not in protected:
                    found.append(self._uses[h][0])
            return found
        finally:
            for h in taken:
                self._hqueue(h)

    def set_hint_order(self, on: bool, /) -> None:
        on = bool(on)
        if on == self._hold:
            return
        self._hold = on
        tags = self._tag
        if on:
            for h in list(self._uses):
                tag = tags.get(h, TAGS)
                if tag < RESIDENT_TAGS:
                    self._hold_entry(h, tag)
            return
        uses = self._uses
        held = [(h, tag) for tag in range(RESIDENT_TAGS) for h in self._held[tag]]
        held.sort(key=lambda item: -uses[item[0]][0])  # farthest first: the nearest ends last
        for h, tag in held:
            self._main[tag][h] = self._detach(h, tag)

    def _ready_aside(self, tag: int, taken: list[tuple[int, Key]]) -> Iterator[tuple[Key, Handle]]:
        """The ready entries set aside in ``tag``, in stamp order, popped
        from the heap; each popped pair is appended to ``taken`` (to be
        queued again unless its entry leaves)."""
        heap, queued, aside, refs = self._heap[tag], self._queued[tag], self._aside[tag], self._refs
        while heap:
            stamp, h = heapq.heappop(heap)
            if queued.get(h) != stamp:
                continue  # superseded by a later pair
            del queued[h]
            entry = aside.get(h)
            if entry is None or entry[0] != stamp or refs.get(h, 0):
                continue  # no longer set aside with it, or busy: queued again when ready
            taken.append((stamp, h))
            yield h, entry[1]

    # -- changes ------------------------------------------------------------

    def _drop(self, h: Key) -> Handle:
        """Take a resident entry out of its order and out of the table (a
        hinted one stays as a hint-only entry)."""
        handle = self._detach(h, self._tag.pop(h))
        if h in self._uses:
            self.window_resident -= 1
        ref = self._refs.pop(h, 0)
        if ref > 0:
            self.pinned -= 1
        elif ref < 0:
            self.in_flight -= 1
        self._resident -= 1
        return handle

    def insert(
        self, hashes: Iterable[Key], handles: Iterable[Handle], tag: int | Iterable[int]
    ) -> None:
        hashes, handles = list(hashes), list(handles)
        if len(hashes) != len(handles):
            raise ValueError(f"{len(hashes)} hashes but {len(handles)} handles")
        if isinstance(tag, int):
            tags = [_resident_tag(tag)] * len(hashes)
        else:
            tags = [_resident_tag(t) for t in tag]
            if len(tags) != len(hashes):
                raise ValueError(f"{len(hashes)} hashes but {len(tags)} tags")
        seen: set[Key] = set()
        get = self._tag.get
        for h in hashes:
            if get(h, TAGS) < RESIDENT_TAGS or h in seen:
                raise ValueError(h)
            seen.add(h)
        uses, hold = self._uses, self._hold
        for h, handle, t in zip(hashes, handles, tags, strict=True):
            old = get(h)
            if old is not None:  # a ghost
                del self._ghosts[old - RESIDENT_TAGS][h]
            self._tag[h] = t
            self._refs[h] = -1
            if h not in uses:
                self._main[t][h] = handle
                continue
            self.window_resident += 1
            if hold:  # in flight: held, not in the heap until ready
                self._held[t][h] = handle
                self.holds += 1
            else:
                self._main[t][h] = handle
        self._resident += len(hashes)
        self.in_flight += len(hashes)

    def insert_chain(
        self, hashes: Iterable[Key], handles: Iterable[Handle], tag: int, readmit: int
    ) -> list[int] | None:
        hashes, handles = list(hashes), list(handles)
        tag, readmit = _resident_tag(tag), _resident_tag(readmit)
        if len(hashes) != len(handles):
            raise ValueError(f"{len(hashes)} hashes but {len(handles)} handles")
        tags = self.tags(reversed(hashes))
        where = [readmit if t >= RESIDENT_TAGS else tag for t in tags]
        self.insert(hashes[::-1], handles[::-1], where)
        if hashes and tags[0] < RESIDENT_TAGS:  # the last hash was no ghost: cold
            self.move(hashes[-1], tag, last=False)
        met = [t for t in reversed(tags) if t >= RESIDENT_TAGS]
        return met or None

    def complete(self, hashes: Iterable[Key], /) -> list[Key]:
        hashes = self._resident_list(hashes)
        refs = self._refs
        done = [h for h in dict.fromkeys(hashes) if refs.get(h, 0) < 0]
        # else no entry can be set aside or held (the usual case)
        aside = any(self._aside) or any(self._held)
        for h in done:
            del refs[h]
            if aside:
                self._ready_again(h)
        self.in_flight -= len(done)
        return done

    def fail(self, hashes: Iterable[Key], /) -> list[Handle]:
        hashes = self._resident_list(hashes)
        refs = self._refs
        return [self._drop(h) for h in dict.fromkeys(hashes) if refs.get(h, 0) < 0]

    def pin(self, hashes: Iterable[Key], /) -> list[Handle]:
        hashes = self._resident_list(hashes)
        refs = self._refs
        for h in hashes:
            if refs.get(h, 0) < 0:
                raise ValueError(h)
        handles = []
        aside = any(self._aside) or any(self._held)
        for h in hashes:
            n = refs.get(h, 0)
            tag = self._tag[h]
            if not n:
                self.pinned += 1
                if aside:
                    self._busy_again(h, tag)
            refs[h] = n + 1
            handles.append(self._handle(h, tag))
        return handles

    def unpin(self, hashes: Iterable[Key], /) -> list[Key]:
        hashes = self._resident_list(hashes)
        refs = self._refs
        for h, k in Counter(hashes).items():
            if refs.get(h, 0) < k:
                raise ValueError(h)
        released = []
        aside = any(self._aside) or any(self._held)
        for h in hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
                continue
            del refs[h]
            self.pinned -= 1
            released.append(h)
            if aside:
                self._ready_again(h)
        return released

    def remove(self, h: Key, /) -> Handle:
        if self._tag.get(h, TAGS) >= RESIDENT_TAGS:
            return None
        return self._drop(h)

    def move(self, h: Key, tag: int, last: bool = True) -> None:
        tag = _resident_tag(tag)
        last = bool(last)  # first, as the C table does: a raising __bool__ changes nothing
        old = self._tag.get(h, TAGS)
        if old >= RESIDENT_TAGS:
            raise KeyError(h)
        if h in self._held[old]:  # held: only its tag changes
            self._retag(h, old, tag)
            return
        handle = self._detach(h, old)
        self._tag[h] = tag
        if last:
            self._main[tag][h] = handle
        else:
            self._set_aside(h, tag, handle, self._early)
            self._early -= 1

    def relist(self, hashes: Iterable[Key], tag: int) -> None:
        tag = _resident_tag(tag)
        hashes = self._resident_list(hashes)
        main = self._main[tag]
        for h in hashes:
            old = self._tag[h]
            if h in self._held[old]:
                self._retag(h, old, tag)
                continue
            main[h] = self._detach(h, old)
            self._tag[h] = tag

    def trim(self, tag: int, keep: int) -> int:
        ghosts = self._ghosts[_ghost_tag(tag) - RESIDENT_TAGS]
        if type(keep) is not int or keep < 0:
            raise ValueError(f"keep must be an int >= 0, got {keep!r}")
        drop = max(0, len(ghosts) - keep)
        for _ in range(drop):
            h, _ = ghosts.popitem(last=False)
            del self._tag[h]
        return drop

    # -- touch ----------------------------------------------------------------

    def set_touch_rules(self, rules: TouchRules, /) -> None:
        if not isinstance(rules, TouchRules):
            raise TypeError(f"set_touch_rules() takes a TouchRules, got {rules!r}")
        self._ready_to, self._in_flight_to = rules.moves()
        self._touch_ghosts = rules.ghosts

    def forget_policy(self) -> None:
        for ghosts in self._ghosts:
            for h in ghosts:
                del self._tag[h]
            ghosts.clear()
        self._ready_to, self._in_flight_to = _DEFAULT_MOVES
        self._touch_ghosts = False
        self.set_hint_order(False)

    def touch(self, hashes: Iterable[Key], /) -> list[int] | None:
        tags, refs, mains = self._tag, self._refs, self._main
        hits: list[int] | None = None
        # every hash is looked up before anything moves (a key whose hash
        # raises changes nothing); a visit changes only its own entry's tag
        rev = [h for h in reversed(list(hashes)) if tags.get(h) is not None]
        for h in rev:
            tag = tags[h]
            if tag >= RESIDENT_TAGS:
                if self._touch_ghosts:
                    self._ghosts[tag - RESIDENT_TAGS].move_to_end(h)
                    if hits is None:
                        hits = []
                    hits.append(tag)
                continue
            dest = self._ready_to[tag] if refs.get(h, 0) >= 0 else self._in_flight_to[tag]
            if dest < 0:
                continue
            main = mains[tag]
            if dest == tag and h in main:
                main.move_to_end(h)
            elif h in self._held[tag]:
                if dest != tag:
                    self._retag(h, tag, dest)
            else:
                mains[dest][h] = self._detach(h, tag)
                tags[h] = dest
        return hits

    # -- eviction ---------------------------------------------------------------

    def evict(
        self,
        a: int,
        n: int,
        protected: Container[Key],
        *,
        b: int | None = None,
        first: int | None = None,
        ghost_a: int | None = None,
        ghost_b: int | None = None,
        spill: bool = False,
        target: float | None = None,
        trim: int | None = None,
    ) -> tuple[list[Key], list[Handle], int] | None:
        a = _resident_tag(a)
        lists = [a] if b is None else [a, _resident_tag(b)]
        if b == a:
            raise ValueError(f"a and b must be different lists, got {a} twice")
        ghost_of = [None if g is None else _ghost_tag(g) for g in (ghost_a, ghost_b)]
        if type(n) is not int:
            raise TypeError(f"n must be an int, got {n!r}")
        if first is not None and type(first) is not int:
            raise TypeError(f"first must be an int or None, got {first!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if target is not None:
            if first is not None:
                raise TypeError("evict() takes first or target, not both")
            if type(target) is bool or not isinstance(target, (int, float)):
                raise TypeError(f"target must be a number or None, got {target!r}")
            if not math.isfinite(target):
                raise ValueError(f"target must be finite, got {target!r}")
        if trim is not None:
            if type(trim) is not int:
                raise TypeError(f"trim must be an int or None, got {trim!r}")
            if trim < 0:
                raise ValueError(f"trim must be >= 0, got {trim!r}")
        spill = bool(spill)
        if target is not None:  # in floating point, as kvarc computed it
            first = int(float(self.size(a) + n) - float(target))
        first = n if first is None else max(0, min(first, n))
        if n == 0:
            return [], [], 0
        room = sum(len(self._main[t]) + self._aside_ready[t] for t in lists)
        if n > room + (sum(self._held_ready[t] for t in lists) if spill else 0):
            return None
        refs = self._refs
        ok = False
        # each list is walked lazily: its ready entries set aside (popped
        # from its heap), then its entries in line; nothing else moves until
        # the victims are known
        taken: list[list[tuple[int, Key]]] = [[] for _ in lists]
        walks = [
            chain(self._ready_aside(t, taken[i]), self._main[t].items())
            if self._heap[t]
            else iter(self._main[t].items())
            for i, t in enumerate(lists)
        ]
        passed: list[list[Key]] = [[] for _ in lists]  # entries in line walked past
        victims: list[list[tuple[Key, Handle]]] = [[] for _ in lists]
        held_taken: list[Key] = []  # popped from the held heap
        held: list[tuple[Key, int, Handle]] = []  # held victims, with their tags

        def walk(i: int, want: int) -> None:
            found, aside = victims[i], self._aside[lists[i]]
            if len(found) >= want:
                return
            for h, handle in walks[i]:
                self.walked += 1
                if refs.get(h, 0) or h in protected:
                    if h not in aside:
                        passed[i].append(h)
                    continue
                found.append((h, handle))
                if len(found) >= want:
                    return

        try:
            walk(0, first)
            if len(lists) == 2 and len(victims[0]) < n:
                walk(1, n - len(victims[0]))
            total = sum(map(len, victims))
            if total < n:
                walk(0, n - total + len(victims[0]))
            total = sum(map(len, victims))
            if spill and total < n:
                # then the held entries of these lists, farthest next use first
                for h, tag, handle in self._ready_held(held_taken):
                    if tag not in lists:
                        continue
                    self.walked += 1
                    if h in protected:
                        continue
                    held.append((h, tag, handle))
                    if total + len(held) == n:
                        break
            ok = total + len(held) == n
        finally:
            gone_held = {h for h, _, _ in held} if ok else set()
            for h in held_taken:
                if h not in gone_held:
                    self._hqueue(h)
            for i, t in enumerate(lists):
                if taken[i]:  # popped from the heap: back unless evicted
                    gone = {h for h, _ in victims[i]} if ok else set()
                    for stamp, h in taken[i]:
                        if h not in gone:
                            self._queue(t, h, stamp)
        if not ok:
            return None
        hashes: list[Key] = []
        handles: list[Handle] = []
        uses = self._uses

        def leave(h: Key, handle: Handle, ghost: int | None) -> None:
            hashes.append(h)
            handles.append(handle)
            if h in uses:
                self.window_resident -= 1
            if ghost is None:
                del self._tag[h]  # a hinted one stays as a hint-only entry
            else:
                self._tag[h] = ghost
                self._ghosts[ghost - RESIDENT_TAGS][h] = None

        for i, t in enumerate(lists):
            ghost, main = ghost_of[i], self._main[t]
            self._evicted[t][0] += len(victims[i])
            for h, handle in victims[i]:
                if h in main:
                    del main[h]
                else:
                    self._detach(h, t)
                leave(h, handle, ghost)
            for h in passed[i]:  # in walking order: later stamps than any before
                self._set_aside(h, t, main.pop(h), self._late)
                self._late += 1
        for h, tag, handle in held:
            self._evicted[tag][1] += 1
            self._detach(h, tag)
            leave(h, handle, ghost_of[lists.index(tag)])
        self._resident -= n
        if trim is not None:  # a ghost list past twice trim, back to trim
            for g in dict.fromkeys(g for g in ghost_of if g is not None):
                if len(self._ghosts[g - RESIDENT_TAGS]) > 2 * trim:
                    self.trim(g, trim)
        return hashes, handles, len(victims[0])


class TableList(Mapping[Key, Handle]):
    """One list of a block table as a read-only mapping, oldest first:
    hash -> handle for a resident tag, hash -> ``None`` for a ghost tag
    (what vLLM's ARC manager exposes as ``t1``, ``b1``...)."""

    __slots__ = ("_table", "_tag")

    def __init__(self, table: Any, tag: int) -> None:
        self._table = table
        self._tag = _any_tag(tag)

    def __getitem__(self, h: Key) -> Handle:
        if self._table.tag_of(h) != self._tag:
            raise KeyError(h)
        return self._table.get(h)

    def __contains__(self, h: object) -> bool:
        return bool(self._table.tag_of(h) == self._tag)

    def __len__(self) -> int:
        return int(self._table.size(self._tag))

    def __iter__(self) -> Iterator[Key]:
        return iter(self._table.keys(self._tag))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


def _choose() -> tuple[type, str]:
    if os.environ.get("KVOFFLOAD_PURE_PYTHON", "") not in ("", "0"):
        return PyBlockTable, "python"
    try:
        from kvoffload._table import BlockTable as CBlockTable
    except ImportError as e:
        warnings.warn(
            f"kvoffload's C block table is not available ({e}); using the pure-Python "
            "one, about 3x slower. Reinstall kvoffload where a C compiler is available, "
            "or set KVOFFLOAD_PURE_PYTHON=1 to choose the pure-Python table knowingly.",
            RuntimeWarning,
            stacklevel=2,
        )
        return PyBlockTable, "python"
    return CBlockTable, "c"


_CHOSEN = _choose()
#: which block table managers use: ``"c"`` or ``"python"``
IMPLEMENTATION: str = _CHOSEN[1]
if TYPE_CHECKING:  # both have the interface kvoffload/_table.pyi declares
    from kvoffload._table import BlockTable
else:
    #: the block table a manager uses: the C one when it was built
    BlockTable = _CHOSEN[0]

__all__ = [
    "IMPLEMENTATION",
    "NO_TAG",
    "RESIDENT_TAGS",
    "STAY",
    "TAGS",
    "USE_STRIDE",
    "BlockTable",
    "PyBlockTable",
    "TableList",
    "TouchRules",
]
