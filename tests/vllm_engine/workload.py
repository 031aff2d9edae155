"""The workload of the engine tier and one run of it in a real vLLM engine.

Prompt A is a 640-token prefix P plus 20 tokens; four unrelated 640-token
prompts follow (together far more than the 64-block "GPU" cache, so P is
pushed out of it); then A again (P can only come from the offload tier) and
B, P plus 20 other tokens. One ``generate`` per prompt keeps the order
fixed. Greedy decoding, 16 tokens each.

Also a script: ``python workload.py MODEL_DIR EXTRA_CONFIG_JSON OUT_JSON
[ENGINE_ARGS_JSON]`` runs the workload in a fresh process and writes each
step's output and cached tokens to OUT_JSON, and with an ``admin_port`` what
the admin server answered at the end (the tier uses it for an engine whose
core runs in its own process, and for one with two tensor-parallel worker
processes); ENGINE_ARGS_JSON adds arguments to vLLM's ``LLM``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GPU_BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 64
PREFIX_TOKENS = 640
MAX_TOKENS = 16
#: What the tests set unless they say otherwise (facts from running vLLM
#: 0.11.2's CPU build here: engine core in-process, no CPU pinning).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
}


def prompts(vocab: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(2, vocab, n)]

    prefix = tokens(PREFIX_TOKENS)
    a = prefix + tokens(20)
    others = [(f"x{i}", tokens(PREFIX_TOKENS)) for i in range(1, 5)]
    return [("a", a), *others, ("a_again", a), ("b", prefix + tokens(20))]


def midblock_prompts(vocab: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """A (the same as in :func:`prompts`), then two prompts that take just
    enough of vLLM's 63 usable GPU blocks to evict A's last 5 (it frees a
    request's blocks tail first): 22 + 21 + 25 blocks. A's GPU prefix hit is
    then 17 blocks, which ends inside an offloaded block of 64 tokens."""
    a, x1 = prompts(vocab, seed)[:2]
    rng = np.random.default_rng(seed + 1)
    x2 = [int(t) for t in rng.integers(2, vocab, 25 * GPU_BLOCK_SIZE - MAX_TOKENS)]
    return [a, x1, ("x2", x2), ("a_again", a[1])]


def make_llm(
    model_dir: Path,
    extra: Mapping[str, Any] | None,
    *,
    kv_events: bool = False,
    scheduler_cls: str | None = None,
    engine: Mapping[str, Any] | None = None,
) -> Any:
    """A vLLM engine on the tiny model; ``extra`` is the connector's whole
    extra config (``None``: no offloading); ``kv_events`` turns vLLM's KV
    cache events on (handed to vLLM's null publisher); ``scheduler_cls``
    replaces vLLM's scheduler; ``engine`` adds arguments to ``LLM``."""
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kv = None
    if extra is not None:
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra),
        )
    return LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=GPU_BLOCK_SIZE,
        num_gpu_blocks_override=NUM_GPU_BLOCKS,
        max_model_len=1024,
        max_num_seqs=4,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv,
        scheduler_cls=scheduler_cls,
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
        **(engine or {}),
    )


@contextmanager
def failing_engine_start() -> Iterator[None]:
    """Around an engine start that must fail: vLLM 0.11.2 keeps the failed
    engine's worker connector in its process global (EngineCore.shutdown()
    would release it), and the next engine in this process would get it
    instead of its own. Release it as shutdown does."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        yield
    finally:
        ensure_kv_transfer_shutdown()


def free_port() -> int:
    """A loopback port nothing listens on now, below the kernel's ephemeral
    range: vLLM picks its own ports (torch.distributed's store, its message
    queues) by binding port 0 while the engine starts, before the spec binds
    the admin port, and a port from that range could be handed to vLLM in
    between (CI saw it once, with two tensor-parallel workers)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for port in random.sample(range(10000, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000-{low - 1}")


def kvoffload_extra(**extra: Any) -> dict[str, Any]:
    return {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm", **extra}


@dataclass
class Step:
    """One prompt's ``generate`` and what kvoffload did meanwhile."""

    name: str
    output: tuple[int, ...]
    #: vLLM's ``RequestOutput.num_cached_tokens``: prompt tokens not computed
    cached_tokens: int
    #: deltas of the live manager's counters (0 without offloading)
    hit_blocks: int = 0
    load_blocks: int = 0
    #: (direction, GPU blocks, bytes, ok) of the jobs the handler finished
    transfers: list[tuple[str, int, int, bool]] = field(default_factory=list)

    def transferred(self, direction: str) -> int:
        assert all(ok for *_, ok in self.transfers), self.transfers
        return sum(blocks for d, blocks, _, _ in self.transfers if d == direction)


@dataclass
class Run:
    steps: dict[str, Step] = field(default_factory=dict)
    #: the live manager's final stats, the handler's layouts, shapes and bytes
    stats: Any = None
    layouts: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_gpu_blocks: int = 0
    gpu_block_bytes: int = 0
    #: the tier's events in each batch vLLM's scheduler published (its KV
    #: events) as (removed, block hashes); batches without any left out
    published: list[list[tuple[bool, tuple[bytes, ...]]]] = field(default_factory=list)

    def outputs(self) -> dict[str, tuple[int, ...]]:
        return {name: s.output for name, s in self.steps.items()}


def record_published(llm: Any, into: list[list[tuple[bool, tuple[bytes, ...]]]]) -> None:
    """Record the offload tier's events in every batch the in-process
    scheduler hands its KV event publisher (which then publishes it as before)."""
    from vllm.distributed.kv_events import BlockRemoved

    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    publish = publisher.publish

    def recording(batch: Any) -> None:
        tier = [
            (isinstance(ev, BlockRemoved), tuple(ev.block_hashes))
            for ev in batch.events
            if getattr(ev, "medium", None) == "CPU"
        ]
        if tier:
            into.append(tier)
        publish(batch)

    publisher.publish = recording


def run_workload(
    model_dir: Path,
    extra: Mapping[str, Any] | None,
    *,
    zero_loaded_kv: bool = False,
    in_process: bool = True,
    workload: Callable[[int], list[tuple[str, list[int]]]] = prompts,
    kv_events: bool = False,
    before: Callable[[str, Any], None] | None = None,
    engine: Mapping[str, Any] | None = None,
) -> Run:
    """Run the workload in a new engine, then drop it. With ``in_process``
    (the engine core in this process) the run also reads kvoffload's live
    manager and handler and records the tier's events vLLM's scheduler
    publishes; without, only what vLLM answers. ``before(name, manager)``
    runs before each prompt's ``generate``, and with ``"end"`` before the
    engine shuts down. ``engine`` adds arguments to vLLM's ``LLM``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import kvoffload.vllm as kv

    known = {id(m) for m in kv.live_managers()} | {id(h) for h in kv.live_handlers()}
    llm = make_llm(model_dir, extra, kv_events=kv_events, engine=engine)
    manager = next((m for m in kv.live_managers() if id(m) not in known), None)
    handler = next((h for h in kv.live_handlers() if id(h) not in known), None)
    run = Run()
    if extra is not None and in_process:
        assert manager is not None and handler is not None, "KVOffloadSpec was not used"
        handler.zero_loaded_kv_for_testing = zero_loaded_kv
        record_published(llm, run.published)
    records: list[Any] = []
    remove = kv.add_transfer_listener(records.append)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    try:
        # ids the tokenizer knows too: vLLM refuses prompts with others
        vocab = min(llm.llm_engine.model_config.get_vocab_size(), len(llm.get_tokenizer()))
        for name, token_ids in workload(vocab):
            if before is not None:
                before(name, manager)
            counters = manager.stats().counters if manager is not None else None
            seen = len(records)
            (out,) = llm.generate(
                [TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False
            )
            step = Step(name, tuple(out.outputs[0].token_ids), int(out.num_cached_tokens))
            if manager is not None and counters is not None:
                after = manager.stats().counters
                step.hit_blocks = after.hit_blocks - counters.hit_blocks
                step.load_blocks = after.load_blocks - counters.load_blocks
                step.transfers = [(r.direction, r.blocks, r.nbytes, r.ok) for r in records[seen:]]
            run.steps[name] = step
        if before is not None:
            before("end", manager)
        if manager is not None and handler is not None:
            run.stats = manager.stats()
            inner = handler.inner
            run.layouts = dict(inner.layouts)
            run.shapes = {
                n: tuple(t.shape) for n, t in zip(inner.layouts, inner.gpu_tensors, strict=True)
            }
            run.num_gpu_blocks = inner.num_gpu_blocks
            run.gpu_block_bytes = inner.gpu_block_bytes
    finally:
        remove()
        # vLLM 0.11.2's LLM has no close(): shutting the engine core down is
        # what resets the process-global worker connector, so that the next
        # engine in this process builds its own
        llm.llm_engine.engine_core.shutdown()
        del llm, manager, handler
        gc.collect()
    return run


def read_admin(port: int, into: dict[str, Any]) -> Callable[[str, Any], None]:
    """A ``before`` hook that reads the admin server on ``port`` (in the
    engine-core process) at the end: /v1/cache, /metrics, and how many
    admin servers run in this process."""

    def before(name: str, manager: Any) -> None:
        if name != "end":
            return
        import httpx

        import kvoffload.vllm as kv

        url = f"http://127.0.0.1:{port}"
        into["cache"] = httpx.get(f"{url}/v1/cache").json()
        into["metrics"] = httpx.get(f"{url}/metrics").text
        into["servers_here"] = len(kv.live_admin_servers())

    return before


if __name__ == "__main__":
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    model, extra_json, out_json = sys.argv[1:4]
    extra = json.loads(extra_json)
    engine = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    admin: dict[str, Any] = {}
    hook = read_admin(extra["admin_port"], admin) if "admin_port" in extra else None
    result = run_workload(Path(model), extra, in_process=False, before=hook, engine=engine)
    steps = {
        s.name: {"output": s.output, "cached_tokens": s.cached_tokens}
        for s in result.steps.values()
    }
    Path(out_json).write_text(json.dumps({"steps": steps, "admin": admin}))
