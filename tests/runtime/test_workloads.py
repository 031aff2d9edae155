"""Workloads: trace loading, engine block mapping, the synthetic generator,
pacing and looping."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.errors import KVOffloadError
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.trace import TraceWorkload, load_mooncake_trace
from kvoffload.runtime.workloads import (
    Pacer,
    Request,
    WorkloadError,
    engine_block_hashes,
    loop,
    paced,
)

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"

GOOD_ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]},
]


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_lines() -> list[str]:
    return [json.dumps(row) for row in GOOD_ROWS]


# --------------------------------------------------------------------------- trace loader


def test_load_trace_reads_fields_and_converts_ms_to_seconds(tmp_path: Path) -> None:
    trace = load_mooncake_trace(write_trace(tmp_path / "t.jsonl", [*good_lines(), ""]))
    assert list(trace) == [
        Request(0, 0.0, (0, 1), 1000, 10),
        Request(1, 1.5, (0, 2), 600, 3),
    ]
    assert trace.len_hint == 2
    assert trace.trace_block_size == 512
    assert trace.block_accesses == 4
    assert trace.unique_blocks == 3
    assert list(trace) == list(trace)  # re-iterable
    assert "t.jsonl: 2 requests, 4 block accesses, 3 unique blocks of 512 tokens" in (
        trace.describe()
    )


def test_load_trace_limit_and_block_size(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", good_lines())
    trace = load_mooncake_trace(path, limit=1, trace_block_size=16)
    assert len(trace) == 1
    assert trace.trace_block_size == 16


@pytest.mark.parametrize(
    ("name", "requests", "accesses", "unique"),
    [
        ("mooncake_conversation_trace.jsonl", 12_031, 288_500, 182_790),
        ("mooncake_synthetic_trace.jsonl", 3_993, 121_877, 43_924),
    ],
)
def test_load_trace_real_files_match_their_readme(
    name: str, requests: int, accesses: int, unique: int
) -> None:
    trace = load_mooncake_trace(TRACES / name)
    assert (len(trace), trace.block_accesses, trace.unique_blocks) == (requests, accesses, unique)
    assert all(len(r.block_ids) == math.ceil(r.input_length / 512) for r in trace)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"input_length": 1, "output_length": 1, "hash_ids": [3]}', "missing field 'timestamp'"),
        (
            '{"timestamp": "9", "input_length": 1, "output_length": 1, "hash_ids": [3]}',
            "field 'timestamp' must be a non-negative number",
        ),
        (
            '{"timestamp": 2000, "input_length": -1, "output_length": 1, "hash_ids": [3]}',
            "field 'input_length' must be a non-negative integer, got -1",
        ),
        (
            '{"timestamp": 2000, "input_length": 1, "output_length": true, "hash_ids": [3]}',
            "field 'output_length' must be a non-negative integer, got True",
        ),
        (
            '{"timestamp": 2000, "input_length": 1, "output_length": 1, "hash_ids": 3}',
            "field 'hash_ids' must be a list",
        ),
        (
            '{"timestamp": 2000, "input_length": 1, "output_length": 1, "hash_ids": [3, "x"]}',
            "field 'hash_ids' item 1 must be an integer",
        ),
        (
            '{"timestamp": 1000, "input_length": 1, "output_length": 1, "hash_ids": [3]}',
            "field 'timestamp' goes back in time",
        ),
    ],
)
def test_load_trace_malformed_line_names_line_and_field(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [*good_lines(), line])
    with pytest.raises(WorkloadError) as info:
        load_mooncake_trace(path)
    message = str(info.value)
    assert f"{path}: line 3: " in message
    assert expected in message


def test_load_trace_missing_file_is_a_workload_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"trace file not found: .*nope\.jsonl"):
        load_mooncake_trace(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="directory"):
        load_mooncake_trace(tmp_path)
    assert issubclass(WorkloadError, KVOffloadError)


def test_load_trace_reads_a_gzip_file_through(tmp_path: Path) -> None:
    # it was "not a UTF-8 text file (invalid start byte)"
    plain = load_mooncake_trace(TRACES / "mooncake_synthetic_trace.jsonl", limit=200)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress((TRACES / "mooncake_synthetic_trace.jsonl").read_bytes()))
    assert list(load_mooncake_trace(packed, limit=200)) == list(plain)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:300])
    with pytest.raises(WorkloadError, match=r"broken\.jsonl\.gz: not a readable gzip file"):
        load_mooncake_trace(broken)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("packed", [True, False], ids=["gzip", "text"])
def test_load_trace_tells_gzip_from_text_when_a_pipe_gives_one_byte_first(
    tmp_path: Path, packed: bool
) -> None:
    # the check peeked at what one read gave: a writer that delivered the
    # first byte alone made a gzip stream "not a UTF-8 text file"
    text = (TRACES / "mooncake_synthetic_trace.jsonl").read_bytes()[:20_000].rsplit(b"\n", 1)[0]
    data = gzip.compress(text) if packed else text
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with fifo.open("wb", buffering=0) as pipe:
            pipe.write(data[:1])
            time.sleep(0.2)  # the reader's first read returns the one byte
            pipe.write(data[1:])

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    streamed = list(load_mooncake_trace(fifo))
    writer.join(5)
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(text)
    assert streamed == list(load_mooncake_trace(plain))
    assert len(streamed) > 10


# --------------------------------------------------------------------------- block mapping

ids_lists = st.lists(st.integers(0, 2**64 - 1), max_size=6)


@given(
    shared=ids_lists,
    tail_a=ids_lists,
    tail_b=ids_lists,
    ratio=st.sampled_from([1, 2, 4, 32]),
)
def test_engine_hashes_share_exactly_the_shared_prefix(
    shared: list[int], tail_a: list[int], tail_b: list[int], ratio: int
) -> None:
    # make the tails diverge at their first element
    if tail_a and tail_b and tail_a[0] == tail_b[0]:
        tail_b[0] = (tail_b[0] + 1) % 2**64
    a = engine_block_hashes(shared + tail_a, trace_block_size=512, engine_block_size=512 // ratio)
    b = engine_block_hashes(shared + tail_b, trace_block_size=512, engine_block_size=512 // ratio)
    assert len(a) == len(shared + tail_a) * ratio
    k = len(shared) * ratio
    assert a[:k] == b[:k]
    # chained: after the divergence nothing is shared, anywhere
    assert not set(a[k:]) & set(b)
    assert not set(b[k:]) & set(a)
    assert len(set(a)) == len(a)
    assert all(type(h) is bytes and len(h) == 16 for h in a)


@given(shared=ids_lists, tail_a=ids_lists, tail_b=ids_lists, group=st.sampled_from([1, 2, 3]))
def test_engine_hashes_group_trace_blocks_into_bigger_engine_blocks(
    shared: list[int], tail_a: list[int], tail_b: list[int], group: int
) -> None:
    if tail_a and tail_b and tail_a[0] == tail_b[0]:
        tail_b[0] = (tail_b[0] + 1) % 2**64
    a = engine_block_hashes(shared + tail_a, trace_block_size=16, engine_block_size=16 * group)
    b = engine_block_hashes(shared + tail_b, trace_block_size=16, engine_block_size=16 * group)
    assert len(a) == len(shared + tail_a) // group  # a trailing partial group is dropped
    k = len(shared) // group
    assert a[:k] == b[:k]
    assert not set(a[k:]) & set(b)


def test_engine_hashes_are_deterministic_and_cut_to_full_blocks() -> None:
    ids = [7, 8, 9]
    full = engine_block_hashes(ids, trace_block_size=512, engine_block_size=16)
    assert full == engine_block_hashes(ids, trace_block_size=512, engine_block_size=16)
    assert len(full) == 96
    # 1000 tokens fill 62 blocks of 16; the partial 63rd is not hashed
    cut = engine_block_hashes(ids, trace_block_size=512, engine_block_size=16, num_tokens=1000)
    assert cut == full[:62]
    # sub-block hashes are not the same as one block per id
    assert engine_block_hashes(ids, trace_block_size=512, engine_block_size=512)[0] != full[0]


def test_engine_hashes_reject_sizes_that_do_not_divide() -> None:
    with pytest.raises(WorkloadError, match="must divide one another"):
        engine_block_hashes([1], trace_block_size=512, engine_block_size=48)
    with pytest.raises(WorkloadError, match="positive"):
        engine_block_hashes([1], trace_block_size=512, engine_block_size=0)


# --------------------------------------------------------------------------- synthetic


def small(seed: int = 0, **kw: object) -> SyntheticWorkload:
    return SyntheticWorkload(SyntheticConfig(seed=seed, num_requests=3000, **kw))  # type: ignore[arg-type]


def test_synthetic_is_deterministic_per_seed() -> None:
    first = list(small(seed=7))
    assert first == list(small(seed=7))
    workload = small(seed=7)
    assert list(workload) == list(workload)  # every pass is the same
    assert first != list(small(seed=8))


def test_synthetic_shape_mix_chains_and_lengths() -> None:
    config = SyntheticConfig(
        num_requests=6000, chat_weight=2, document_weight=1, one_off_weight=1, trace_block_size=64
    )
    requests = list(SyntheticWorkload(config))
    assert len(requests) == 6000
    kinds = Counter(r.kind for r in requests)
    assert abs(kinds["chat"] / 6000 - 0.5) < 0.03
    assert abs(kinds["document"] / 6000 - 0.25) < 0.03
    assert abs(kinds["one_off"] / 6000 - 0.25) < 0.03
    assert [r.request_id for r in requests] == list(range(6000))
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    # mean gap of a Poisson process at 20 req/s
    assert 0.045 < times[-1] / 5999 < 0.055
    assert all(len(r.block_ids) == math.ceil(r.input_length / 64) for r in requests)
    # chained like the traces: an id always comes after the same prefix
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in requests:
        for position, block_id in enumerate(r.block_ids):
            assert prefix_of.setdefault(block_id, r.block_ids[:position]) == r.block_ids[:position]
    # ids are handed out in order of first appearance
    first_seen = list(dict.fromkeys(b for r in requests for b in r.block_ids))
    assert first_seen == list(range(len(first_seen)))
    # there is reuse of every kind but one-off prompts
    seen: set[int] = set()
    reused: Counter[str] = Counter()
    for r in requests:
        reused[r.kind] += r.block_ids[0] in seen
        seen.update(r.block_ids)
    assert reused["chat"] > 0.9 * kinds["chat"]
    assert reused["document"] > 0.5 * kinds["document"]
    assert reused["one_off"] == 0


def test_synthetic_endless_and_describe() -> None:
    workload = SyntheticWorkload(SyntheticConfig(num_requests=None, seed=3))
    assert workload.len_hint is None
    assert len(list(itertools.islice(workload, 20_000))) == 20_000
    text = workload.describe()
    assert text.startswith("synthetic (seed 3): endless")
    assert "50% chat" in text and "30% questions on 2000 Zipf(0.9) documents" in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_requests": -1}, "num_requests"),
        ({"requests_per_second": 0.0}, "requests_per_second"),
        ({"chat_weight": 0.0, "document_weight": 0.0, "one_off_weight": 0.0}, "mix weights"),
        ({"chat_weight": -1.0}, "mix weights"),
        ({"open_chats": 0}, "open_chats"),
        ({"mean_turns": 0.5}, "mean_turns"),
        ({"document_blocks": (5, 2)}, "document_blocks"),
        ({"zipf_exponent": float("nan")}, "zipf_exponent"),
    ],
)
def test_synthetic_rejects_bad_parameters(change: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        SyntheticWorkload(SyntheticConfig(**change))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- pacing


class FakeClock:
    """A clock that only moves when the code under test sleeps (or the test says so)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def at(*times: float) -> list[Request]:
    return [Request(i, t, (i,), 1, 1) for i, t in enumerate(times)]


def test_paced_as_fast_as_possible_never_sleeps() -> None:
    clock = FakeClock()
    assert list(paced(at(5.0, 9.0, 60.0), None, clock=clock, sleep=clock.sleep)) == at(
        5.0, 9.0, 60.0
    )
    assert clock.sleeps == []


def test_paced_follows_timestamps_scaled_by_speed() -> None:
    clock = FakeClock()
    issued: list[float] = []
    for _ in paced(at(10.0, 11.0, 15.0), 2.0, clock=clock, sleep=clock.sleep):
        issued.append(clock.now)
    # relative to the first request, at twice real time
    assert issued == [100.0, 100.5, 102.5]
    assert clock.sleeps == [0.5, 2.0]


def test_paced_does_not_sleep_for_overdue_requests() -> None:
    clock = FakeClock()
    out = paced(at(0.0, 1.0, 2.0), 1.0, clock=clock, sleep=clock.sleep)
    next(out)
    clock.now += 10.0  # the consumer was slow
    assert [r.request_id for r in out] == [1, 2]
    assert clock.sleeps == []


def test_pacer_delay_and_bad_speed() -> None:
    clock = FakeClock()
    pacer = Pacer(0.5, clock=clock)
    first, second = at(3.0, 4.0)
    assert pacer.delay(first) == 0.0
    assert pacer.delay(second) == 2.0  # 1 s of trace time at half speed
    clock.now += 1.5
    assert pacer.delay(second) == 0.5
    assert Pacer(math.inf, clock=clock).speed is None
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(WorkloadError, match="speed"):
            Pacer(bad)


# --------------------------------------------------------------------------- looping


def test_loop_repeats_with_shifted_ids_and_times() -> None:
    inner = TraceWorkload(at(0.0, 1.0, 2.0), name="three")
    looped = loop(inner)
    out = list(itertools.islice(looped, 8))
    assert [r.request_id for r in out] == [0, 1, 2, 3, 4, 5, 6, 7]
    # span 2 s + mean gap 1 s: the second pass starts 3 s after the first
    assert [r.arrival_time for r in out] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert [r.block_ids for r in out[3:6]] == [r.block_ids for r in inner]
    assert looped.describe() == inner.describe() + ", looped endlessly"
    assert looped.trace_block_size == 512


def test_loop_of_an_empty_workload_ends() -> None:
    assert list(loop(TraceWorkload([], name="empty"))) == []


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (
            '{"timestamp": 1'
            + "0" * 400
            + ', "input_length": 1, "output_length": 1, "hash_ids": [1]}',
            "field 'timestamp' must be a non-negative number",
        ),
        (
            '{"timestamp": 0, "input_length": 1'
            + "0" * 5000
            + ', "output_length": 1, "hash_ids": []}',
            "a number of more than 4300 digits",
        ),
        (
            '{"timestamp": 0, "hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "JSON nested too deeply to read",
        ),
    ],
)
def test_load_trace_odd_lines_are_workload_errors(tmp_path: Path, line: str, says: str) -> None:
    # once OverflowError, ValueError and RecursionError (a traceback from
    # `kvoffload replay`), not the line and field the docs promise
    trace = tmp_path / "odd.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=f"{trace}: line 1: {says}"):
        load_mooncake_trace(trace)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"limit": 1.5}, "limit must be an int >= 0, got 1.5"),
    ({"trace_block_size": 0.5}, "trace_block_size must be a positive int, got 0.5"),
    ({"trace_block_size": True}, "trace_block_size must be a positive int, got True"),
])  # fmt: skip
def test_load_trace_checks_its_arguments_types(
    tmp_path: Path, kwargs: dict[str, object], says: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(WorkloadError, match=re.escape(says)):
        load_mooncake_trace(trace, **kwargs)  # type: ignore[arg-type]
