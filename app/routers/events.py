"""The event log: read after a cursor, drain, or tail live over SSE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query
from fastapi.responses import StreamingResponse

from app.deps import AdminAccess, ReadAccess, ServiceDep
from app.errors import error_responses
from app.models import (
    MAX_EVENTS_LIMIT,
    MAX_SEQ,
    DrainRequest,
    DrainResult,
    EventPageView,
    EventView,
)
from app.state import ServiceState
from kvoffload.event_log import EVENT_KINDS

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["events"])

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
                        "description": "`missed` event: records after the cursor that are gone",
                        "required": ["missed", "after_seq"],
                        "properties": {
                            "missed": {"type": "integer", "minimum": 1},
                            "after_seq": {"type": "integer", "minimum": 0},
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
]


@router.get(
    "/events",
    response_model=EventPageView,
    summary="Read events after a cursor (non-destructive)",
    description="Records are returned oldest first. When the cursor fell off the ring "
    "(or records were drained), `missed` says how many are gone. Continue with "
    "`after_seq=next_after_seq`.",
    responses=error_responses(401, 422),
)
async def read_events(
    _: ReadAccess,
    service: ServiceDep,
    after_seq: AfterSeq = 0,
    limit: Annotated[
        int,
        Query(ge=1, le=MAX_EVENTS_LIMIT, description=f"at most {MAX_EVENTS_LIMIT}"),
    ] = 1000,
) -> EventPageView:
    log = service.engine.event_log
    page = log.read(after_seq, limit)
    return EventPageView(
        events=[EventView.from_record(r) for r in page.records],
        missed=page.missed,
        next_after_seq=page.next_after_seq,
        last_seq=log.last_seq,
    )


@router.post(
    "/events:drain",
    response_model=DrainResult,
    summary="Remove and return the oldest events (destructive)",
    description=f"Without a body, drains up to {MAX_EVENTS_LIMIT} records. Readers whose "
    "cursor pointed at drained records are told they missed them.",
    responses=error_responses(400, 401, 403, 422),
)
async def drain_events(
    _: AdminAccess,
    service: ServiceDep,
    body: Annotated[DrainRequest | None, Body()] = None,
) -> DrainResult:
    log = service.engine.event_log
    limit = body.limit if body is not None else MAX_EVENTS_LIMIT
    with service.tracer.start_as_current_span(
        "kvoffload.admin.drain_events",
        attributes={"kvoffload.admin.action": "drain_events", "kvoffload.admin.limit": limit},
    ) as span:
        records = log.drain(limit)
        span.set_attributes(
            {"kvoffload.admin.outcome": "applied", "kvoffload.events.drained": len(records)}
        )
    return DrainResult(events=[EventView.from_record(r) for r in records], remaining=len(log))


@router.get(
    "/events/stream",
    summary="Live tail of the event log (server-sent events)",
    description="Each record is an SSE event: `id` = seq, `event` = kind, `data` = the "
    "record as JSON. Reconnect with `Last-Event-ID` to resume after the last record "
    "seen (the stream starts after the larger of the two). Records lost in between come as one `missed` "
    "event. Comment lines are heartbeats. The stream ends after `limit` records, when "
    "the client goes away, or when the service shuts down.",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "An endless stream of server-sent events",
            "content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}},
        },
        **error_responses(401, 422),
    },
)
async def stream_events(
    _: ReadAccess,
    service: ServiceDep,
    after_seq: AfterSeq = 0,
    limit: Annotated[
        int,
        Query(ge=1, le=MAX_SEQ, description="end the stream after this many records"),
    ] = MAX_SEQ,
    last_event_id: Annotated[
        int,
        Header(
            alias="Last-Event-ID",
            ge=0,
            le=MAX_SEQ,
            description="the seq of the last record received; resume after it",
        ),
    ] = 0,
) -> StreamingResponse:
    # A reconnecting EventSource sends its original URL plus the last id it
    # saw, which is never behind the after_seq it started from.
    cursor = max(after_seq, last_event_id)
    return StreamingResponse(
        _sse(service, cursor, limit),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _record_event(view: EventView) -> str:
    return f"id: {view.seq}\nevent: {view.kind}\ndata: {view.model_dump_json()}\n\n"


async def _sse(service: ServiceState, cursor: int, limit: int) -> AsyncIterator[str]:
    engine = service.engine
    log = engine.event_log
    heartbeat = service.settings.sse_heartbeat
    remaining = limit
    yield "retry: 2000\n\n"
    if cursor > log.last_seq:
        # A cursor from an earlier run of the service: its records are gone.
        yield f": cursor {cursor} is ahead of the log (last seq {log.last_seq}); starting there\n\n"
        cursor = log.last_seq
    last_write = time.monotonic()
    while remaining > 0:
        stopped = service.stopping.is_set() or engine.state == "stopped"
        chunk: list[str] = []
        if log.last_seq > cursor:
            batch = min(_STREAM_BATCH, remaining)
            page = log.read(cursor, batch)
            if page.missed:
                chunk.append(
                    f'event: missed\ndata: {{"missed": {page.missed}, "after_seq": {cursor}}}\n\n'
                )
            for record in page.records:
                chunk.append(_record_event(EventView.from_record(record)))
            cursor = page.next_after_seq
            remaining -= len(page.records)
        now = time.monotonic()
        if chunk:
            yield "".join(chunk)
            last_write = now
        elif now - last_write >= heartbeat:
            yield ": heartbeat\n\n"
            last_write = now
        if stopped and (service.stopping.is_set() or log.last_seq <= cursor):
            # Shutting down: end now. Engine stopped: end once caught up.
            return
        if not chunk or log.last_seq <= cursor:
            await asyncio.sleep(_POLL_SECONDS)
