"""The event log: read after a cursor, drain, or tail live over SSE."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Request, Response
from pydantic import BeforeValidator, Field, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from app.auth import GuardedRoute
from app.deps import AdminAccess, EventLogDep, ReadAccess, ServiceDep
from app.errors import ApiError, error_responses
from app.models import (
    MAX_EVENTS_LIMIT,
    MAX_SEQ,
    DrainRequest,
    DrainResult,
    EventPageView,
    EventView,
    decimal_text,
)
from app.state import ServiceState, StreamSlots
from kvoffload.event_log import EVENT_KINDS, EventLog, EventRecord

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["events"], route_class=GuardedRoute)

#: how often a live stream looks for new records
_POLL_SECONDS = 0.05
#: records per poll of a live stream
_STREAM_BATCH = 500

#: One server-sent event, as OpenAPI 3.1 describes an event stream's items.
_SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "the record's seq"},
        "event": {"type": "string", "enum": [*EVENT_KINDS, "missed"]},
        "retry": {"type": "integer", "minimum": 0},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "oneOf": [
                    {"$ref": "#/components/schemas/EventView"},
                    {
                        "type": "object",
                        "description": "`missed` event: records after the cursor the "
                        "stream does not send: gone, or (`skipped`) beyond the replay limit",
                        "required": ["missed", "after_seq"],
                        "properties": {
                            "missed": {"type": "integer", "minimum": 1},
                            "after_seq": {"type": "integer", "minimum": 0},
                            "skipped": {
                                "type": "integer",
                                "minimum": 1,
                                "description": "of `missed`, records still in the log, "
                                "readable with GET /v1/events?after_seq=<after_seq>",
                            },
                        },
                    },
                ]
            },
        },
    },
}

AfterSeq = Annotated[
    int,
    Query(
        ge=0, le=MAX_SEQ, description="return records with seq > after_seq (0 = from the oldest)"
    ),
    BeforeValidator(decimal_text),
]


def _cursor(value: object) -> object:
    # the whole check here, so that a bad cursor is one error, not one per
    # member of the union below
    value = decimal_text(value)
    # digits only, no leading zero (decimal_text): more than 2**53 - 1's 16
    # digits is too large, and int() of thousands of them is Python's error
    if isinstance(value, str) and (len(value) > 16 or int(value) > MAX_SEQ):
        raise PydanticCustomError(
            "less_than_equal", "Input should be at most {max} (2**53 - 1)", {"max": MAX_SEQ}
        )
    return value


def _blank_is_none(value: object) -> object:
    # `Last-Event-ID:` with nothing after it names no record: resume from nothing
    return None if value == "" else value


#: a cursor the stream may start from (its absence means the live tail)
_Cursor = Annotated[int, Field(ge=0, le=MAX_SEQ)]
_OptionalCursor = Annotated[_Cursor | SkipJsonSchema[None], BeforeValidator(_cursor)]
#: seconds a client is asked to wait when every stream slot is taken
STREAMS_FULL_RETRY_AFTER = 5


def _cursor_ahead(name: str, seq: int, last: int) -> ApiError:
    return ApiError(
        409,
        "cursor_ahead",
        f"{name} {seq} is ahead of the log, whose newest seq is {last} (a cursor from before "
        "the service restarted?); read again from after_seq=0 (the oldest records kept) or "
        f"{last} (new ones only)",
        last_seq=last,
    )


@router.get(
    "/events",
    response_model=EventPageView,
    summary="Read events after a cursor (non-destructive)",
    description="Records are returned oldest first. When the cursor fell off the ring "
    "(or records were drained), `missed` says how many are gone. Continue with "
    "`after_seq=next_after_seq`.",
    responses=error_responses(401, 409, 422),
)
async def read_events(
    _: ReadAccess,
    service: ServiceDep,
    log: EventLogDep,
    after_seq: AfterSeq = 0,
    limit: Annotated[
        int,
        Query(ge=1, le=MAX_EVENTS_LIMIT, description=f"at most {MAX_EVENTS_LIMIT}"),
        BeforeValidator(decimal_text),
    ] = 1000,
) -> Response:
    last = log.last_seq
    if after_seq > last:
        raise _cursor_ahead("after_seq", after_seq, last)

    page = log.read(after_seq, limit)
    newest = log.last_seq

    def page_json() -> bytes:
        view = EventPageView(
            events=[EventView.from_record(r) for r in page.records],
            missed=page.missed,
            next_after_seq=page.next_after_seq,
            last_seq=newest,
        )
        return view.model_dump_json().encode()

    body = await service.render(page_json, len(page.records))
    return Response(body, media_type="application/json")


@router.post(
    "/events:drain",
    response_model=DrainResult,
    summary="Remove and return the oldest events (destructive)",
    description=f"Without a body, drains up to {MAX_EVENTS_LIMIT} records. Readers whose "
    "cursor pointed at drained records are told they missed them. Records whose answer "
    "is lost on the way are gone: to lose none, read with `GET /v1/events`, then drain "
    "with `through_seq` (the last seq handled), which is safe to repeat. A client that "
    "has gone before its drain is made drains nothing.",
    responses=error_responses(400, 401, 403, 408, 409, 413, 415, 422),
)
async def drain_events(
    _: AdminAccess,
    request: Request,
    service: ServiceDep,
    log: EventLogDep,
    body: Annotated[DrainRequest, Body()] = DrainRequest(),  # noqa: B008 (read only)
) -> Response:
    limit, through = body.limit, body.through_seq
    if through is not None and through > log.last_seq:
        raise _cursor_ahead("through_seq", through, log.last_seq)
    if await request.is_disconnected():
        # nobody to hand the records to (a client that timed out waiting):
        # no answer, counted `closed` (app.limits)
        raise ClientDisconnect
    with service.tracer.start_as_current_span(
        "kvoffload.admin.drain_events",
        attributes={"kvoffload.admin.action": "drain_events", "kvoffload.admin.limit": limit},
    ) as span:
        records = log.drain(limit, through)
        span.set_attributes(
            {"kvoffload.admin.outcome": "applied", "kvoffload.events.drained": len(records)}
        )
    remaining = len(log)

    def result_json() -> bytes:
        views = [EventView.from_record(r) for r in records]
        return DrainResult(events=views, remaining=remaining).model_dump_json().encode()

    return Response(await service.render(result_json, len(records)), media_type="application/json")


@router.get(
    "/events/stream",
    summary="Live tail of the event log (server-sent events)",
    description="Each record is an SSE event: `id` = seq, `event` = kind, `data` = the "
    "record as JSON. Without a cursor the stream starts at the live tail. Reconnect with "
    "`Last-Event-ID` (or pass `after_seq`) to resume after the last record seen (the "
    "stream starts after the larger of the two); at most `sse_max_replay` records are "
    "replayed, the rest come as one `missed` event with `skipped`, as do records lost "
    "in between. Comment lines are heartbeats. The stream ends after `limit` records, "
    "when the client goes away, or when the service shuts down. 503 `too_many_streams` "
    "(with `Retry-After`) when every stream slot is taken.",
    response_class=EventSourceResponse,
    responses={
        200: {
            "description": "An endless stream of server-sent events",
            "content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}},
        },
        **error_responses(401, 409, 422, 503),
    },
)
async def stream_events(
    _: ReadAccess,
    service: ServiceDep,
    log: EventLogDep,
    # SkipJsonSchema: "absent" is not a value a client can send as null
    after_seq: Annotated[
        _OptionalCursor,
        Query(
            description="send records with seq > after_seq (default: from the live tail)",
        ),
    ] = None,
    limit: Annotated[
        int,
        Query(ge=1, le=MAX_SEQ, description="end the stream after this many records"),
        BeforeValidator(decimal_text),
    ] = MAX_SEQ,
    last_event_id: Annotated[
        _OptionalCursor,
        BeforeValidator(_blank_is_none),
        # the schema says the blank is taken too: a client (and a fuzzer)
        # reads that "" is no cursor, not an integer wrongly accepted
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": MAX_SEQ},
                    {"const": ""},
                ],
                "title": "Last-Event-Id",
            }
        ),
        Header(
            alias="Last-Event-ID",
            description="the seq of the last record received; resume after it (blank: no "
            "cursor, as if absent)",
        ),
    ] = None,
) -> EventSourceResponse:
    cursors = [c for c in (after_seq, last_event_id) if c is not None]
    # A reconnecting EventSource sends its original URL plus the last id it
    # saw, which is never behind the after_seq it started from.
    cursor = max(cursors) if cursors else log.last_seq
    slots = service.streams
    if not slots.take():
        raise ApiError(
            503,
            "too_many_streams",
            f"all {slots.limit} event stream slots are taken; retry later, or read "
            "GET /v1/events after a cursor",
            headers={"Retry-After": str(STREAMS_FULL_RETRY_AFTER)},
        )
    return _SlotStream(
        slots,
        _sse(service, log, cursor, limit),
        ping=service.settings.sse_heartbeat,
        ping_message_factory=lambda: ServerSentEvent(comment="heartbeat", sep="\n"),
        sep="\n",
        headers={"Cache-Control": "no-cache"},
    )


class _SlotStream(EventSourceResponse):
    """An event stream that gives its slot back however it ends (records sent,
    client gone, shutdown)."""

    def __init__(self, slots: StreamSlots, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slots.give_back()


def _record_event(view: EventView) -> str:
    return f"id: {view.seq}\nevent: {view.kind}\ndata: {view.model_dump_json()}\n\n"


def _records_sse(records: Sequence[EventRecord]) -> bytes:
    return "".join(_record_event(EventView.from_record(r)) for r in records).encode()


def _missed_event(missed: int, cursor: int, skipped: int = 0) -> str:
    extra = f',"skipped":{skipped}' if skipped else ""
    return f'event: missed\ndata: {{"missed":{missed},"after_seq":{cursor}{extra}}}\n\n'


async def _sse(
    service: ServiceState, log: EventLog, cursor: int, limit: int
) -> AsyncIterator[bytes]:
    target = service.target
    remaining = limit
    yield b"retry: 2000\n\n"
    last = log.last_seq
    if cursor > last:
        # A cursor from an earlier run of the service: its records are gone.
        yield (
            f": cursor {cursor} is ahead of the log (last seq {last}); "
            f"the stream starts after seq {last}\n\n"
        ).encode()
        cursor = last
    replay_from = last - service.settings.sse_max_replay
    if cursor < replay_from:
        # Replay is bounded per connection: the rest is told, not sent. The
        # read counts the records that are gone as missed, once; the ones
        # still there are skipped (readable with GET /v1/events).
        gone = log.read(cursor, 1).missed
        skip_to = max(replay_from, cursor + gone)
        yield _missed_event(skip_to - cursor, cursor, skip_to - cursor - gone).encode()
        cursor = skip_to
    while remaining > 0:
        stopped = service.stopping.is_set() or target.state == "stopped"
        behind = False
        if log.last_seq > cursor:
            batch = min(_STREAM_BATCH, remaining)
            page = log.read(cursor, batch)
            chunk = _missed_event(page.missed, cursor) if page.missed else ""
            records = page.records
            cursor = page.next_after_seq
            remaining -= len(records)
            behind = len(records) == batch
            if chunk or records:
                events = functools.partial(_records_sse, records)
                yield chunk.encode() + await service.render(events, len(records))
        if stopped and (service.stopping.is_set() or log.last_seq <= cursor):
            # Shutting down: end now. Engine stopped: end once caught up.
            return
        # Sending need not suspend: give the loop its turn, at once when
        # catching up, else after one poll interval.
        await asyncio.sleep(0 if behind else _POLL_SECONDS)
