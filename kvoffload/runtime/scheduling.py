"""One request's blocks, in the order vLLM's offloading connector uses.

``touch`` the request's offloaded hashes; find the GPU prefix hit; ``lookup``
the CPU tier past it, ``prepare_load`` the CPU hits and submit a CPU->GPU job;
"compute" what neither tier had (contents derived from the block hashes);
``prepare_store`` the request's new offloaded blocks and submit GPU->CPU jobs.
Finished jobs are completed by :class:`~kvoffload.runtime.jobs.TransferJobs`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from kvoffload.abstract import BlockHash
from kvoffload.errors import ConfigError
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.mediums import GPULoadStoreSpec
from kvoffload.runtime.config import EngineConfig
from kvoffload.runtime.jobs import TransferJobs
from kvoffload.runtime.kv_store import GPUKVStore
from kvoffload.runtime.observer import RequestRecord
from kvoffload.runtime.snapshot import RuntimeStats
from kvoffload.runtime.workloads import Request, engine_block_hashes

__all__ = ["RequestBlocks", "RequestScheduler"]

logger = logging.getLogger(__name__)


class RequestBlocks(NamedTuple):
    """One request's block hashes: ``gpu`` (one per GPU block of its prompt,
    cut to what the GPU cache can prefill) and ``offloaded`` (one per
    offloaded block: every ``block_factor``-th GPU hash); ``cut``: the GPU
    blocks of the prompt past that."""

    gpu: list[BlockHash]
    offloaded: list[BlockHash]
    cut: int = 0


class RequestScheduler:
    """Serves requests through ``kv`` (the GPU tier) and ``manager`` (the CPU
    tier), submitting their transfers to ``jobs`` (engine thread only).
    ``on_finished`` is told about each request once all of it is known: at
    once, or when the load of its CPU hits finishes."""

    def __init__(
        self,
        config: EngineConfig,
        kv: GPUKVStore,
        manager: PolicyOffloadingManager,
        jobs: TransferJobs,
        counters: RuntimeStats,
        trace_block_size: int,
        on_finished: Callable[[RequestRecord], None],
    ) -> None:
        self.config = config
        self.kv = kv
        self.manager = manager
        self.jobs = jobs
        self.counters = counters
        self.trace_block_size = trace_block_size
        self.on_finished = on_finished
        self._warned_cut = False

    def blocks(self, r: Request) -> RequestBlocks:
        """The GPU and offloaded block hashes ``r`` will use: what the engine
        hints when ``r`` arrives and serves when its turn comes."""
        k = self.config.block_factor
        gpu_hashes = engine_block_hashes(
            r.block_ids,
            trace_block_size=self.trace_block_size,
            engine_block_size=self.config.gpu_block_size,
            num_tokens=r.input_length,
        )
        # A request larger than the GPU cache cannot be prefilled at once;
        # serve the prefix that fits (the rest is counted as truncated).
        limit = max(k, (self.kv.num_blocks // 2) // k * k)
        cut = max(0, len(gpu_hashes) - limit)
        if cut:
            gpu_hashes = gpu_hashes[:limit]
        offloaded = [gpu_hashes[(j + 1) * k - 1] for j in range(len(gpu_hashes) // k)]
        return RequestBlocks(gpu_hashes, offloaded, cut)

    def serve(self, r: Request, step: int, blocks: RequestBlocks | None = None) -> None:
        """Schedule ``r``'s blocks (``blocks``: ``self.blocks(r)``, if known)."""
        started_ns = time.perf_counter_ns()
        cfg = self.config
        kv = self.kv
        m = self.manager
        k = cfg.block_factor
        bs = cfg.gpu_block_size
        gpu_hashes, offloaded, cut = blocks if blocks is not None else self.blocks(r)
        n = len(gpu_hashes)
        if cut and not self._warned_cut:
            self._warned_cut = True
            logger.warning(
                "request %s has %d full GPU blocks of prompt, more than half the GPU cache "
                "(%d of %d blocks) prefills at once: the first %d are served and the rest "
                "counted as truncated tokens, for this and any longer request (raise "
                "num_gpu_blocks, --gpu-blocks, to serve them whole)",
                r.request_id,
                n + cut,
                n,
                kv.num_blocks,
                n,
            )
        if offloaded:
            m.touch(offloaded)
        # Make sure the request's blocks fit, finishing jobs if needed.
        g = kv.prefix_hit(gpu_hashes)
        hit_ids = kv.pin_cached(gpu_hashes[:g])
        while kv.available() < n - g and len(self.jobs):
            self.jobs.collect(wait=True)
        if kv.available() < n - g:  # pragma: no cover - prevented by the limit above
            kv.unpin(hit_ids)
            raise ConfigError(
                f"the GPU cache ({kv.num_blocks} blocks) cannot hold a request of {n} blocks"
            )
        # CPU tier: lookup past the GPU hit, starting at the offloaded block
        # that holds the first GPU miss.
        first_off = g // k
        cpu_hits = m.lookup(offloaded[first_off:]) if first_off < len(offloaded) else 0
        load_end = (first_off + cpu_hits) * k  # GPU blocks covered after loading
        loaded = max(0, load_end - g)
        load_ids: list[int] = []
        record = RequestRecord(
            r.request_id,
            step,
            (n + cut) * bs,
            g * bs,
            loaded * bs,
            (n - g - loaded) * bs,
            started_ns,
            truncated_tokens=cut * bs,
        )
        if loaded:
            load_hashes = offloaded[first_off : first_off + cpu_hits]
            cpu_spec = m.prepare_load(load_hashes)
            load_ids = kv.allocate(gpu_hashes[g:load_end])
            # The GPU hit may end inside the first offloaded block: the
            # handler skips its leading sub-blocks (vLLM defect 7).
            self.jobs.submit(
                "load",
                (cpu_spec, GPULoadStoreSpec(load_ids)),
                load_hashes,
                load_ids,
                gpu_hashes[g:load_end],
                request=record,
            )
        else:
            load_end = g
        # "Compute" what neither tier had.
        comp_ids = kv.allocate(gpu_hashes[load_end:])
        kv.compute(comp_ids, gpu_hashes[load_end:])
        # Store the request's new offloaded blocks (those not loaded).
        store_from = max(first_off + cpu_hits, g // k)
        out = m.prepare_store(offloaded[store_from:]) if store_from < len(offloaded) else None
        all_ids = hit_ids + load_ids + comp_ids
        if out is not None and out.block_hashes_to_store:
            pos = {h: j for j, h in enumerate(offloaded)}
            ids: list[int] = []
            sub_hashes: list[BlockHash] = []
            for h in out.block_hashes_to_store:
                j = pos[h]
                ids.extend(all_ids[j * k : (j + 1) * k])
                sub_hashes.extend(gpu_hashes[j * k : (j + 1) * k])
            kv.pin(ids)  # the store job reads them until it finishes
            self.jobs.submit(
                "store",
                (GPULoadStoreSpec(ids), out.store_spec),
                list(out.block_hashes_to_store),
                ids,
                sub_hashes,
            )
        kv.unpin(hit_ids)
        kv.unpin(comp_ids)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += (n + cut) * bs
        c.truncated_tokens += cut * bs
        c.gpu_hit_tokens += g * bs
        # The loaded tokens are counted when their job finishes (as CPU hits,
        # or as computed if it failed), so no counter ever goes down; until
        # then the three outcomes sum to less than prompt_tokens.
        c.computed_tokens += (n - g - loaded) * bs
        if not loaded:
            self.on_finished(replace(record, finished_ns=time.perf_counter_ns()))
