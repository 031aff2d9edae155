"""A replay of the conversation trace whose counts equal an independent model.

The model below is written from the serving protocol (DESIGN.md section 5),
not from the engine's code: a GPU prefix cache with LRU reuse of unpinned
blocks, and an LRU CPU tier with pins and all-or-nothing eviction. It is
keyed by the trace's own ids (they are chained: an id names its whole
prefix), so it needs neither the engine's block hashes nor its stores.

Setup that makes exact equality possible on the CPU: one request per step,
and a CPU handler that finishes every job at the end of the step that
submitted it, in submit order (load before store).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.engine import Engine
from kvoffload.runtime.observer import EngineObserver, RequestRecord
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload
from kvoffload.runtime.trace import TraceWorkload, load_mooncake_trace

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"

GPU_BLOCK = 128
CPU_BLOCK = 512  # = the trace's block size: one offloaded block per trace id
K = CPU_BLOCK // GPU_BLOCK

GPUKey = tuple[int, int]  # (trace id, GPU sub-block within it)


class ReferenceGPUCache:
    """Blocks are free, cached (reusable, LRU first) or pinned (counted)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = num_blocks
        self.cached: OrderedDict[GPUKey, None] = OrderedDict()
        self.pins: dict[GPUKey, int] = {}

    def resident(self, key: GPUKey) -> bool:
        return key in self.cached or key in self.pins

    def prefix_hit(self, keys: Sequence[GPUKey]) -> int:
        n = 0
        while n < len(keys) and self.resident(keys[n]):
            n += 1
        return n

    def pin(self, key: GPUKey) -> None:
        """Take a reference on a resident block."""
        if key in self.cached:
            del self.cached[key]
            self.pins[key] = 1
        else:
            self.pins[key] += 1

    def allocate(self, key: GPUKey) -> None:
        """A pinned block for ``key``: the one it has (a later block of a
        chain whose earlier block was reused), else a free one, else the
        least recently used cached one."""
        if self.resident(key):
            self.pin(key)
            return
        if self.free:
            self.free -= 1
        else:
            self.cached.popitem(last=False)
        self.pins[key] = 1

    def unpin(self, key: GPUKey) -> None:
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]
            self.cached[key] = None


@dataclass
class ReferenceCPUTier:
    """LRU over trace ids. ``refs``: 0 ready, > 0 being loaded, -1 being stored."""

    capacity: int
    refs: OrderedDict[int, int] = field(default_factory=OrderedDict)
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "lookups",
                "lookup_blocks",
                "hit_blocks",
                "load_blocks",
                "load_completed_blocks",
                "touches",
                "store_prepared_blocks",
                "stored",
                "skipped_present",
                "rejected_no_room",
                "rejected_stores",
                "evictions",
            ),
            0,
        )
    )

    def touch(self, ids: Sequence[int]) -> None:
        self.counters["touches"] += len(ids)
        # the first id ends most recent
        for i in reversed(ids):
            if i in self.refs:
                self.refs.move_to_end(i)

    def lookup(self, ids: Sequence[int]) -> int:
        n = 0
        while n < len(ids) and self.refs.get(ids[n], -1) >= 0:
            n += 1
        self.counters["lookups"] += 1
        self.counters["lookup_blocks"] += len(ids)
        self.counters["hit_blocks"] += n
        return n

    def start_load(self, ids: Sequence[int]) -> None:
        for i in ids:
            self.refs[i] += 1
        self.counters["load_blocks"] += len(ids)

    def finish_load(self, ids: Sequence[int]) -> None:
        for i in ids:
            self.refs[i] -= 1
        self.counters["load_completed_blocks"] += len(ids)

    def prepare_store(self, ids: Sequence[int]) -> list[int] | None:
        named = set(ids)
        new = [i for i in ids if i not in self.refs]
        need = len(new) - (self.capacity - len(self.refs))
        if need > 0:
            victims: list[int] = []
            busy: list[int] = []  # pinned blocks the scan went past
            for i, ref in self.refs.items():
                if len(victims) == need:
                    break
                if ref != 0:
                    busy.append(i)
                elif i not in named:
                    victims.append(i)
            if len(victims) < need:
                self.counters["rejected_stores"] += 1
                self.counters["rejected_no_room"] += len(new)
                return None
            for i in victims:
                del self.refs[i]
            for i in busy:
                self.refs.move_to_end(i)
            self.counters["evictions"] += need
        for i in new:
            self.refs[i] = -1
        self.counters["store_prepared_blocks"] += len(new)
        self.counters["skipped_present"] += len(ids) - len(new)
        return new

    def finish_store(self, ids: Sequence[int]) -> None:
        for i in ids:
            self.refs[i] = 0
        self.counters["stored"] += len(ids)


@dataclass
class ReferenceReplay:
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu: ReferenceGPUCache = field(init=False)
    cpu: ReferenceCPUTier = field(init=False)
    #: per request: (prompt, GPU hit, CPU hit, computed) tokens
    requests: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    jobs: dict[str, int] = field(default_factory=lambda: {"load": 0, "store": 0})
    moved: dict[str, int] = field(default_factory=lambda: {"load": 0, "store": 0})

    def __post_init__(self) -> None:
        self.gpu = ReferenceGPUCache(self.num_gpu_blocks)
        self.cpu = ReferenceCPUTier(self.num_cpu_blocks)

    def serve(self, ids: Sequence[int], input_length: int) -> None:
        gpu, cpu = self.gpu, self.cpu
        # full GPU blocks only, and no more than half the GPU cache (the rest
        # is truncated: counted, not served)
        whole = min(len(ids) * K, input_length // GPU_BLOCK)
        n = min(whole, max(K, self.num_gpu_blocks // 2 // K * K))
        keys = [(ids[p // K], p % K) for p in range(n)]
        offloaded = list(ids[: n // K])
        if offloaded:
            cpu.touch(offloaded)
        g = gpu.prefix_hit(keys)
        for key in keys[:g]:
            gpu.pin(key)
        first = g // K  # the offloaded block holding the first GPU miss
        hits = cpu.lookup(offloaded[first:]) if first < len(offloaded) else 0
        load_end = (first + hits) * K if hits else g
        loads = offloaded[first : first + hits]
        if loads:
            cpu.start_load(loads)
        for key in keys[g:]:  # loaded, then computed
            gpu.allocate(key)
        stores: list[int] | None = None
        if first + hits < len(offloaded):
            stores = cpu.prepare_store(offloaded[first + hits :])
        store_keys = [(i, j) for i in stores or () for j in range(K)]
        for key in store_keys:
            gpu.pin(key)  # the store job reads them
        for key in keys[:g] + keys[load_end:]:
            gpu.unpin(key)
        # the step ends: jobs finish in submit order
        if loads:
            cpu.finish_load(loads)
            for key in keys[g:load_end]:
                gpu.unpin(key)
            self.jobs["load"] += 1
            self.moved["load"] += load_end - g
        if stores:
            cpu.finish_store(stores)
            for key in store_keys:
                gpu.unpin(key)
            self.jobs["store"] += 1
            self.moved["store"] += len(store_keys)
        self.requests.append(
            (
                whole * GPU_BLOCK,
                g * GPU_BLOCK,
                (load_end - g) * GPU_BLOCK,
                (n - load_end) * GPU_BLOCK,
                (whole - n) * GPU_BLOCK,
            )
        )


class Requests(EngineObserver):
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def request_finished(self, record: RequestRecord) -> None:
        self.records.append(record)


def check_chained(trace: TraceWorkload) -> None:
    """The model keys blocks by trace id: valid only if an id fixes its prefix."""
    parent: dict[int, int | None] = {}
    for r in trace:
        for pos, i in enumerate(r.block_ids):
            p = r.block_ids[pos - 1] if pos else None
            assert parent.setdefault(i, p) == p, f"trace id {i} has two parents"


@functools.cache
def workload(name: str) -> TraceWorkload:
    if name == "conversation":
        # little short-range reuse: the CPU tier catches the returning chats
        trace = load_mooncake_trace(TRACES / "mooncake_conversation_trace.jsonl", limit=600)
    else:
        # heavy reuse at short range: the GPU cache's order matters too
        synthetic = SyntheticWorkload(
            SyntheticConfig(
                seed=3,
                num_requests=600,
                trace_block_size=CPU_BLOCK,
                open_chats=16,
                num_documents=40,
                document_blocks=(2, 12),
                one_off_blocks=(1, 12),
            )
        )
        trace = TraceWorkload(list(synthetic), name="synthetic", trace_block_size=CPU_BLOCK)
    check_chained(trace)
    return trace


@pytest.mark.parametrize(
    ("name", "num_gpu_blocks", "num_cpu_blocks"),
    [
        # requests cut to 48 GPU blocks; a CPU tier that evicts
        ("conversation", 96, 1500),
        # a CPU tier smaller than some requests: stores rejected for want of room
        ("conversation", 192, 16),
        ("synthetic", 96, 300),
        ("synthetic", 128, 60),
    ],
)
def test_engine_replay_counts_equal_the_reference_model(
    name: str, num_gpu_blocks: int, num_cpu_blocks: int
) -> None:
    trace = workload(name)
    config = EngineConfig(
        policy="lru",
        gpu_block_size=GPU_BLOCK,
        offloaded_block_size=CPU_BLOCK,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        num_layers=1,
        num_kv_heads=1,
        head_size=4,
        max_requests_per_step=1,
        device="cpu",
    )
    records = Requests()
    engine = Engine(config, trace, [records])
    snap = engine.run()

    ref = ReferenceReplay(num_gpu_blocks, num_cpu_blocks)
    for r in trace:
        ref.serve(r.block_ids, r.input_length)

    got = [
        (x.prompt_tokens, x.gpu_hit_tokens, x.cpu_hit_tokens, x.computed_tokens, x.truncated_tokens)
        for x in records.records
    ]
    assert [x.request_id for x in records.records] == [r.request_id for r in trace]
    for i, (mine, theirs) in enumerate(zip(got, ref.requests, strict=True)):
        assert mine == theirs, f"request {trace.requests[i].request_id}"

    rt = snap.runtime
    totals = [sum(col) for col in zip(*ref.requests, strict=True)]
    assert [
        rt.prompt_tokens,
        rt.gpu_hit_tokens,
        rt.cpu_hit_tokens,
        rt.computed_tokens,
        rt.truncated_tokens,
    ] == totals
    assert (rt.steps, rt.requests) == (len(trace), len(trace))
    assert (rt.load_jobs, rt.store_jobs) == (ref.jobs["load"], ref.jobs["store"])
    assert (rt.loaded_gpu_blocks, rt.stored_gpu_blocks) == (ref.moved["load"], ref.moved["store"])
    assert (rt.failed_jobs, rt.verify_failures) == (0, 0)

    m = snap.manager
    c = m.counters
    expected = ref.cpu.counters
    assert {
        "lookups": c.lookups,
        "lookup_blocks": c.lookup_blocks,
        "hit_blocks": c.hit_blocks,
        "load_blocks": c.load_blocks,
        "load_completed_blocks": c.load_completed_blocks,
        "touches": c.touches,
        "store_prepared_blocks": c.store_prepared_blocks,
        "stored": c.store_blocks["stored"],
        "skipped_present": c.store_blocks["skipped_present"],
        "rejected_no_room": c.store_blocks["rejected_no_room"],
        "rejected_stores": c.rejected_stores,
        "evictions": sum(c.evictions.values()),
    } == expected
    assert c.store_blocks["failed"] == 0
    # every case has GPU hits, CPU evictions, and CPU hits or rejected stores
    assert rt.gpu_hit_tokens > 0
    assert expected["evictions"] > 0
    assert rt.cpu_hit_tokens > 0 or expected["rejected_stores"] > 0
    assert (m.used, m.pinned, m.in_flight) == (len(ref.cpu.refs), 0, 0)
    assert m.used + m.free == m.capacity == num_cpu_blocks
    # the GPU cache ends with every block reusable, holding what the model holds
    assert not ref.gpu.pins
    assert engine.kv.available() == num_gpu_blocks
    assert engine.kv.cached_blocks == len(ref.gpu.cached) == num_gpu_blocks - ref.gpu.free
