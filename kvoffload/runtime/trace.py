"""Mooncake JSONL KV traces as workloads.

One JSON object per line, in arrival order::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``timestamp`` is in milliseconds since the start of the trace, ``hash_ids``
are chained block ids of ``trace_block_size`` tokens (512 in the published
traces). The whole file is validated and loaded up front: a replay should
fail before it starts, naming the line and field, not halfway through.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvoffload._checks import is_int
from kvoffload.runtime.workloads import Request, Workload, WorkloadError

__all__ = ["DEFAULT_TRACE_BLOCK_SIZE", "TraceWorkload", "load_mooncake_trace"]

#: tokens per ``hash_ids`` entry in the published Mooncake traces
DEFAULT_TRACE_BLOCK_SIZE = 512
#: the first bytes of a gzip file (RFC 1952)
_GZIP_MAGIC = b"\x1f\x8b"


class TraceWorkload(Workload):
    """Requests loaded from a trace file, held in memory (a 12k-request trace is
    a few MB)."""

    def __init__(
        self,
        requests: Sequence[Request],
        *,
        name: str,
        trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
    ) -> None:
        self.requests: tuple[Request, ...] = tuple(requests)
        self.name = name
        self.trace_block_size = trace_block_size

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def len_hint(self) -> int:
        return len(self.requests)

    @property
    def block_accesses(self) -> int:
        """Total number of block ids over all requests."""
        return sum(len(r.block_ids) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        """Number of distinct block ids."""
        return len({b for r in self.requests for b in r.block_ids})

    @property
    def span_seconds(self) -> float:
        """Time between the first and the last arrival."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_time - self.requests[0].arrival_time

    def describe(self) -> str:
        return (
            f"Mooncake trace {self.name}: {len(self.requests)} requests, "
            f"{self.block_accesses} block accesses, {self.unique_blocks} unique blocks "
            f"of {self.trace_block_size} tokens over {self.span_seconds:.0f} s"
        )


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    trace_block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
    limit: int | None = None,
) -> TraceWorkload:
    """Load and validate a Mooncake JSONL trace.

    Request ids are the 0-based index of the request in the file; arrival
    times are the timestamps converted to seconds. ``limit`` keeps only the
    first ``limit`` requests (the rest of the file is not read). Blank lines
    are skipped.

    Raises :class:`WorkloadError` when the file is missing or unreadable,
    holds no request, or a line is not a JSON object with the four fields of
    the right types (message: file, 1-based line number, field, what was
    expected), a line's ``hash_ids`` repeats an id, or timestamps decrease.
    ``path`` may be a FIFO or ``/dev/stdin``: the file is read once, as a
    stream. A gzip-compressed file is read through.
    """
    if not is_int(trace_block_size) or trace_block_size <= 0:
        raise WorkloadError(f"trace_block_size must be a positive int, got {trace_block_size!r}")
    if limit is not None and (not is_int(limit) or limit < 0):
        raise WorkloadError(f"limit must be an int >= 0, got {limit!r}")
    trace = Path(path)
    requests: list[Request] = []
    previous_ms: float = -math.inf
    try:
        with trace.open("rb") as raw:
            # a gzip file is read through; its first bytes are read, not
            # sought back to (a FIFO reads once), and put back in front
            head = raw.read(len(_GZIP_MAGIC))
            source: io.BufferedReader | gzip.GzipFile = io.BufferedReader(_Prefixed(head, raw))
            if head == _GZIP_MAGIC:
                source = gzip.GzipFile(fileobj=source)
            lines = io.TextIOWrapper(source, encoding="utf-8")
            for line_no, line in enumerate(lines, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if not line.strip():
                    continue
                request = _parse_line(trace, line_no, line, len(requests))
                timestamp_ms = request.arrival_time * 1000.0
                if timestamp_ms < previous_ms:
                    raise WorkloadError(
                        f"{trace}: line {line_no}: field 'timestamp' goes back in time "
                        f"({timestamp_ms:g} ms after {previous_ms:g} ms); "
                        "expected non-decreasing arrival order"
                    )
                previous_ms = timestamp_ms
                requests.append(request)
    except FileNotFoundError:
        raise WorkloadError(f"trace file not found: {trace}") from None
    except IsADirectoryError:
        raise WorkloadError(f"trace path is a directory, not a file: {trace}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{trace}: not a UTF-8 text file ({exc.reason})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise WorkloadError(f"{trace}: not a readable gzip file ({exc})") from None
    except OSError as exc:
        raise WorkloadError(f"cannot read trace file {trace}: {exc.strerror}") from None
    if not requests and limit != 0:
        raise WorkloadError(f"{trace}: no requests (the file is empty or only blank lines)")
    return TraceWorkload(requests, name=trace.name, trace_block_size=trace_block_size)


class _Prefixed(io.RawIOBase):
    """``head``, then the rest of ``stream``: the bytes read to tell a gzip
    file from text, put back. (A peek could not do it: on a pipe it returns
    what one read gave, which may be a single byte.)"""

    def __init__(self, head: bytes, stream: io.BufferedIOBase) -> None:
        self._head, self._stream = head, stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        head = self._head
        if not head:
            return self._stream.readinto(buffer)
        n = min(len(buffer), len(head))
        buffer[:n] = head[:n]
        self._head = head[n:]
        return n


def _parse_line(trace: Path, line_no: int, line: str, request_id: int) -> Request:
    where = f"{trace}: line {line_no}"
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        # some messages end in "at" ("Unterminated string starting at")
        message = exc.msg.removesuffix(" at")
        raise WorkloadError(f"{where}: not valid JSON ({message} at column {exc.colno})") from None
    except RecursionError:
        raise WorkloadError(f"{where}: JSON nested too deeply to read") from None
    except ValueError:  # an integer of more digits than int() reads
        raise WorkloadError(
            f"{where}: a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(row, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(row).__name__}")

    def field(name: str) -> Any:
        if name not in row:
            raise WorkloadError(f"{where}: missing field {name!r}")
        return row[name]

    def count(name: str) -> int:
        value = field(name)
        # bool is an int subclass; a true/false here is a broken writer, not a count
        if not is_int(value) or value < 0:
            raise WorkloadError(
                f"{where}: field {name!r} must be a non-negative integer, got {value!r}"
            )
        return value

    timestamp = field("timestamp")
    try:
        ms = float(timestamp) if not isinstance(timestamp, bool | str) else math.nan
    except (TypeError, OverflowError):  # not a number, or an integer past any float
        ms = math.nan
    if not math.isfinite(ms) or ms < 0:
        raise WorkloadError(
            f"{where}: field 'timestamp' must be a non-negative number of milliseconds, "
            f"got {timestamp!r}"
        )
    input_length = count("input_length")
    output_length = count("output_length")
    hash_ids = field("hash_ids")
    if not isinstance(hash_ids, list):
        raise WorkloadError(
            f"{where}: field 'hash_ids' must be a list of non-negative integers, "
            f"got {type(hash_ids).__name__}"
        )
    for position, block_id in enumerate(hash_ids):
        # ids are packed as unsigned 64-bit integers when hashed for an engine
        if not is_int(block_id) or not 0 <= block_id < 2**64:
            raise WorkloadError(
                f"{where}: field 'hash_ids' item {position} must be an integer in "
                f"[0, 2**64), got {block_id!r}"
            )
    # an id names a chained prefix: it has one position, never two
    if len(set(hash_ids)) < len(hash_ids):
        first, again = _repeat(hash_ids)
        raise WorkloadError(
            f"{where}: field 'hash_ids' repeats id {hash_ids[first]} (items {first} and "
            f"{again}); expected distinct ids, each naming one prefix block"
        )
    return Request(
        request_id=request_id,
        arrival_time=ms / 1000.0,
        block_ids=tuple(hash_ids),
        input_length=input_length,
        output_length=output_length,
    )


def _repeat(ids: Sequence[int]) -> tuple[int, int]:
    """The positions of the first id of ``ids`` seen twice (there is one)."""
    seen: dict[int, int] = {}
    for position, block_id in enumerate(ids):
        first = seen.setdefault(block_id, position)
        if first != position:
            return first, position
    raise AssertionError("no id repeats")
