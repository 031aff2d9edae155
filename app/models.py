"""Request and response bodies of the admin API.

Response models are built from the engine's immutable snapshots by the
``from_*`` constructors; request models reject unknown fields so that a typo
is an error, not a silent no-op.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator
from pydantic_core import PydanticCustomError

from app.policy_name import PolicyName
from kvoffload.event_log import EventKind, EventLogStats, EventRecord
from kvoffload.runtime.commands import CommandResult
from kvoffload.runtime.snapshot import EngineSnapshot, EngineState, RuntimeStats
from kvoffload.stats import ManagerCounters

__all__ = [
    "MAX_EVENTS_LIMIT",
    "ARCState",
    "BlockCounts",
    "CacheCounters",
    "CacheView",
    "CommandView",
    "DrainRequest",
    "DrainResult",
    "EventLogView",
    "EventPageView",
    "EventView",
    "HealthView",
    "PolicySwitchRequest",
    "PolicySwitchResult",
    "PolicyValidateRequest",
    "PolicyValidation",
    "PolicyView",
    "ResetRequest",
    "RuntimeCounters",
    "WindowView",
]

#: the most events one read, drain or page returns
MAX_EVENTS_LIMIT = 10_000
#: the highest cursor or version a client may send: the largest integer a JSON
#: number (an IEEE double) holds exactly, so clients and validators agree on it
MAX_SEQ = 2**53 - 1


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


def _json_integer(value: object) -> object:
    """Let an integer field take what JSON Schema calls an integer (3, 3.0) and
    nothing else: lax pydantic would also take true and "3"."""
    if isinstance(value, bool | str):
        raise PydanticCustomError(
            "int_type",
            "Input should be a valid integer, not {kind}",
            {"kind": "a boolean" if isinstance(value, bool) else "a string"},
        )
    return value


_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def decimal_text(value: object) -> object:
    """A query parameter or header that is an integer: its text is the
    digits of one, and nothing else (lax pydantic would also take ``+1``,
    ``1_0``, `` 1``, ``01`` and ``1.0``)."""
    if isinstance(value, str) and not _DECIMAL.fullmatch(value):
        shown = repr(value) if len(value) <= 32 else f"{value[:32]!r}..."
        raise PydanticCustomError(
            "int_parsing",
            "Input should be a decimal integer, digits only (such as 100), not {value}",
            {"value": shown},
        )
    return value


class _Request(BaseModel):
    # strict: JSON `true` is not the number 1, "2" is not the version 2
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --------------------------------------------------------------------------- cache


class BlockCounts(_Response):
    """Offloaded (CPU) blocks by state; ``used + free == capacity``."""

    capacity: int = Field(description="offloaded blocks the CPU tier holds")
    used: int = Field(description="offloaded blocks holding data or a store in flight")
    free: int = Field(description="offloaded blocks unallocated")
    pinned: int = Field(description="resident offloaded blocks being loaded (ref_cnt > 0)")
    in_flight: int = Field(description="offloaded blocks whose store is in flight (ref_cnt = -1)")


class ARCState(_Response):
    """The four lists of an ARC-family policy (arc, kvarc, hkvarc) and its
    adaptive target for T1; hkvarc's t1 and t2 are its blocks in line, its
    held ones are h1 and h2 in ``lists``."""

    t1: int = Field(description="resident offloaded blocks seen once (recent)")
    t2: int = Field(description="resident offloaded blocks seen at least twice (frequent)")
    b1: int = Field(description="ghosts: hashes of offloaded blocks evicted from T1 (no data)")
    b2: int = Field(description="ghosts: hashes of offloaded blocks evicted from T2 (no data)")
    target_t1_size: float = Field(description="the adaptive target size of T1, in offloaded blocks")


def _model_of(
    cls: type, doc: str, descriptions: Mapping[str, str], name: str | None = None
) -> type[_Response]:
    """A response model with the fields of the dataclass ``cls``, their types,
    and ``descriptions`` (one per field, no more: a field added to ``cls``
    without a description fails here, at import)."""
    names = [f.name for f in dataclasses.fields(cls)]
    if set(names) != set(descriptions):
        raise TypeError(
            f"describe exactly the fields of {cls.__name__}: "
            f"missing {sorted(set(names) - set(descriptions))}, "
            f"unknown {sorted(set(descriptions) - set(names))}"
        )
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {n: (hints[n], Field(description=descriptions[n])) for n in names}
    model: type[_Response] = create_model(
        name or cls.__name__, __base__=_Response, __doc__=doc, **fields
    )
    return model


_CACHE_COUNTERS = {
    "lookups": "lookup calls",
    "lookup_blocks": "offloaded blocks named by lookups",
    "hit_blocks": "offloaded blocks lookups found ready (the hit prefixes)",
    "load_blocks": "offloaded blocks pinned for loading by prepare_load",
    "load_completed_blocks": "offloaded blocks unpinned by complete_load (loads finished, "
    "successful or not)",
    "touches": "offloaded blocks named by touch calls",
    "store_prepared_blocks": "offloaded blocks allocated for storing by prepare_store",
    "store_blocks": "offloaded blocks named in stores, by outcome: stored, skipped_present, "
    "failed, rejected_no_room",
    "rejected_stores": "prepare_store calls rejected for lack of room",
    "evictions": "offloaded blocks evicted, by the resident list they left",
    "ghost_hits": "hits on a ghost list (a remembered hash of an evicted offloaded block), "
    "by list: touches for arc, re-stores for kvarc",
    "policy_switches": "live policy switches applied",
}

if TYPE_CHECKING:
    CacheCounters = _Response
    RuntimeCounters = _Response
else:
    CacheCounters = _model_of(
        ManagerCounters,
        "Monotonic manager counters since start (a policy switch keeps them), in offloaded "
        "blocks of `block_size` tokens.",
        _CACHE_COUNTERS,
        name="CacheCounters",
    )
    RuntimeCounters = _model_of(
        RuntimeStats,
        "Monotonic counters of the serving loop since start (reset keeps them); its block "
        "counts are of GPU blocks of `gpu_block_size` tokens.",
        {f.name: f.metadata["description"] for f in dataclasses.fields(RuntimeStats)},
        name="RuntimeCounters",
    )


class EventLogView(_Response):
    """Event-log counts, read when the answer is made; at a quiet moment
    ``appended == overwritten + drained + buffered``."""

    appended: int = Field(description="records ever appended")
    overwritten: int = Field(
        description="records pushed out of the full ring by newer ones before any drain took "
        "them (normal without a drainer: readers that keep up still read them)"
    )
    drained: int = Field(description="records removed by drains")
    missed: int = Field(
        description="records readers asked for after a cursor > 0 that were already gone "
        "(overwritten or drained), summed over the answers (a read from 0, the oldest kept, "
        "misses nothing): a consumer is losing records"
    )
    buffered: int = Field(description="records in the ring now")
    capacity: int = Field(description="records the ring holds")
    last_seq: int = Field(description="seq of the newest record (0 if none)")

    @classmethod
    def from_stats(cls, s: EventLogStats) -> EventLogView:
        return cls.model_validate(s, from_attributes=True)


class WindowView(_Response):
    """The hint window: the requests waiting to be served that the manager
    was told about (the runtime hints its whole waiting queue), whatever the
    policy; ``hkvarc`` orders blocks by their next use in it."""

    requests: int = Field(description="requests in the window (hinted, not served yet)")
    uses: int = Field(description="offloaded block hashes they will use, repeats counted")
    blocks: int = Field(description="distinct offloaded blocks they will use")
    resident: int = Field(description="of those, the ones resident in the offload tier now")


class CacheView(_Response):
    """The cache at one instant: every field comes from the same snapshot,
    except ``events``, the event log's counts when the answer was made."""

    policy: str
    policy_version: int
    state: EngineState = Field(description="engine state: running, paused, finished...")
    step: int = Field(description="engine steps completed when the snapshot was taken")
    timestamp: float = Field(description="when the snapshot was taken (Unix seconds)")
    workload: str
    block_size: int = Field(
        description="tokens per offloaded block: the unit of blocks, lists, arc and counters"
    )
    gpu_block_size: int | None = Field(
        description="tokens per GPU block: the unit of runtime's block counts (null for a "
        "hosted manager, whose host owns the GPU side)"
    )
    medium: str
    blocks: BlockCounts
    lists: dict[str, int] = Field(
        description="offloaded blocks in each resident list of the policy"
    )
    ghost_lists: dict[str, int] = Field(
        description="hashes of evicted offloaded blocks remembered in each ghost list of the "
        "policy (no data; arc, kvarc, hkvarc)"
    )
    arc: ARCState | None = Field(
        description="T1/T2/B1/B2 and target; null unless the policy is of the ARC family"
        " (arc, kvarc, hkvarc)"
    )
    window: WindowView
    policy_counters: dict[str, int] = Field(
        description="the policy's own counts since start, summed over every time it was the "
        "policy (hkvarc: deferred, redirected, declined_blocks, hinted_hits; none for lru, arc, "
        "kvarc), in offloaded blocks"
    )
    hit_ratio: float = Field(
        ge=0.0,
        le=1.0,
        description="offloaded blocks hit / offloaded blocks looked up, since start",
    )
    counters: CacheCounters
    runtime: RuntimeCounters
    events: EventLogView | None

    @classmethod
    def from_view(cls, snap: EngineSnapshot, events: EventLogStats | None) -> CacheView:
        """The cache as ``snap`` shows it, with the event log's counts ``events``
        (read live: drains and reads happen outside the snapshot)."""
        m = snap.manager
        arc_lists, target = m.arc_lists, m.target_t1_size
        arc = None
        if arc_lists is not None and target is not None:
            arc = ARCState(**arc_lists, target_t1_size=target)
        return cls(
            policy=m.policy,
            policy_version=snap.policy_version,
            state=snap.state,
            step=snap.step,
            timestamp=snap.timestamp,
            workload=snap.workload,
            block_size=m.block_size,
            gpu_block_size=snap.gpu_block_size,
            medium=m.medium,
            blocks=BlockCounts(
                capacity=m.capacity,
                used=m.used,
                free=m.free,
                pinned=m.pinned,
                in_flight=m.in_flight,
            ),
            lists=m.resident_lists,
            ghost_lists=m.ghost_lists,
            arc=arc,
            window=WindowView.model_validate(m.window, from_attributes=True),
            policy_counters=dict(m.policy_counters),
            hit_ratio=m.hit_ratio,
            counters=CacheCounters.model_validate(m.counters, from_attributes=True),
            runtime=RuntimeCounters.model_validate(snap.runtime, from_attributes=True),
            events=EventLogView.from_stats(events) if events is not None else None,
        )


def _must_be_true(schema: dict[str, Any]) -> None:
    # required and true in the schema; the model's default (False) only lets
    # the route answer a missing field `confirmation_required`
    schema.pop("default", None)
    schema["const"] = True


class ResetRequest(_Request):
    """Reset evicts every resident block that is not in use; say you mean it."""

    # required in the schema; absent, the route answers confirmation_required
    model_config = ConfigDict(json_schema_extra={"required": ["confirm"]})

    confirm: bool = Field(
        default=False,
        description="must be true: reset drops the cached blocks",
        json_schema_extra=_must_be_true,
    )


# --------------------------------------------------------------------------- policy


class PolicyView(_Response):
    policy: str
    version: int = Field(
        description="bumped by every applied switch; send it back as expected_version"
    )
    available: list[str]


class PolicySwitchRequest(_Request):
    """Switch the eviction policy. Resident blocks migrate; nothing is flushed."""

    policy: PolicyName
    expected_version: int | None = Field(
        None,
        ge=1,
        le=MAX_SEQ,
        strict=False,
        description="apply only if the policy version is still this one (else 409)",
    )

    _integer = field_validator("expected_version", mode="before")(_json_integer)


class PolicyValidateRequest(PolicySwitchRequest):
    """The same body as a switch; nothing is applied."""


class PolicySwitchResult(_Response):
    policy: str
    previous_policy: str | None
    version: int
    applied_at_step: int = Field(description="engine steps completed when the switch took effect")


class PolicyValidation(_Response):
    valid: Literal[True]
    policy: str
    current_policy: str
    current_version: int


# --------------------------------------------------------------------------- runtime


class CommandView(_Response):
    """What an applied command did and when."""

    kind: Literal["switch_policy", "pause", "resume", "reset"]
    applied_at_step: int
    state: EngineState = Field(description="engine state right after the command")
    policy: str
    policy_version: int
    detail: dict[str, str]

    @classmethod
    def from_result(cls, result: CommandResult, state: EngineState) -> CommandView:
        return cls(
            kind=result.kind,
            applied_at_step=result.applied_at_step,
            state=state,
            policy=result.policy,
            policy_version=result.policy_version,
            detail=dict(result.detail),
        )


# --------------------------------------------------------------------------- events


class EventView(_Response):
    seq: int
    timestamp: float
    kind: EventKind
    block_hashes: list[str] = Field(description="hex-encoded block hashes")
    block_size: int
    medium: str
    detail: dict[str, str]

    @classmethod
    def from_record(cls, r: EventRecord) -> EventView:
        return cls(
            seq=r.seq,
            timestamp=r.timestamp,
            kind=r.kind,
            block_hashes=[bytes(h).hex() for h in r.block_hashes],
            block_size=r.block_size,
            medium=r.medium,
            detail=dict(r.detail),
        )


class EventPageView(_Response):
    events: list[EventView]
    missed: int = Field(
        description="records after the cursor that are gone (fell off the ring or were drained)"
    )
    next_after_seq: int = Field(description="pass as after_seq to continue")
    last_seq: int = Field(description="newest seq ever appended")


class DrainRequest(_Request):
    limit: int = Field(
        default=MAX_EVENTS_LIMIT,
        strict=False,
        ge=1,
        le=MAX_EVENTS_LIMIT,
        description=f"remove at most this many oldest records (at most {MAX_EVENTS_LIMIT})",
    )
    through_seq: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SEQ,
        strict=False,
        description="remove only records with seq <= through_seq: the last seq you have "
        "handled (read with GET /v1/events). A drain repeated after a lost answer then "
        "removes nothing more; without it, records whose answer was lost are gone",
    )

    _integer = field_validator("limit", "through_seq", mode="before")(_json_integer)


class DrainResult(_Response):
    events: list[EventView] = Field(description="the removed records, oldest first")
    remaining: int = Field(description="records still buffered")


# --------------------------------------------------------------------------- health


class HealthView(_Response):
    status: Literal["ok", "unavailable"]
    state: EngineState | None = None
    detail: str | None = None
