"""What vLLM 0.11.2's scheduler tells an offloading spec about requests that
wait (issue 19: could a spec learn the blocks of requests it will serve
soon?). The calls of vLLM's own OffloadingConnectorScheduler are recorded
step by step while one ``generate`` gets more prompts than the engine runs
at once; docs/vllm.md ("Waiting requests") says what it means."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .workload import GPU_BLOCK_SIZE, MAX_TOKENS, kvoffload_extra, make_llm


@dataclass
class Calls:
    """Per scheduler step (one ``build_connector_meta`` each): the requests
    looked up (``get_num_new_matched_tokens``: a ``touch`` of all their
    blocks, then a ``lookup``) and those scheduled for the first time."""

    step: int = 0
    looked_up: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    scheduled: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    #: (step, request, number of block hashes touched) in call order
    touches: list[tuple[int, str, int]] = field(default_factory=list)
    #: the step of each call of the manager's take_events
    taken: list[int] = field(default_factory=list)

    def first(self, table: dict[int, list[str]], request: str) -> int:
        return min(step for step, reqs in table.items() if request in reqs)

    def waits(self, request: str) -> int:
        """Steps in which ``request`` was looked up but not scheduled."""
        return sum(
            request in reqs and request not in self.scheduled[step]
            for step, reqs in self.looked_up.items()
        )


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """Record what vLLM's connector asks on the scheduler side (its own
    methods run unchanged)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnectorScheduler as Connector,
    )

    record = Calls()
    matched, meta = Connector.get_num_new_matched_tokens, Connector.build_connector_meta
    take = Connector.take_events

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        record.looked_up[record.step].append(request.request_id)
        blocks = len(request.block_hashes) // self.block_size_factor
        record.touches.append((record.step, request.request_id, blocks))
        return matched(self, request, num_computed_tokens)

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        for new in scheduler_output.scheduled_new_reqs:
            record.scheduled[record.step].append(new.req_id)
        out = meta(self, scheduler_output)
        record.step += 1
        return out

    def take_events(self: Any) -> Iterator[Any]:
        # the step counter moved on in this step's build_connector_meta
        record.taken.append(record.step - 1)
        yield from take(self)

    monkeypatch.setattr(Connector, "take_events", take_events)
    monkeypatch.setattr(Connector, "get_num_new_matched_tokens", get_num_new_matched_tokens)
    monkeypatch.setattr(Connector, "build_connector_meta", build_connector_meta)
    yield record


def generate_at_once(model_dir: Path, blocks_per_prompt: int, n: int) -> list[str]:
    """``n`` unrelated prompts of ``blocks_per_prompt`` GPU blocks in one
    ``generate``; returns the request ids in submission order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model_dir, kvoffload_extra(num_cpu_blocks=256))
    try:
        vocab = min(llm.llm_engine.model_config.get_vocab_size(), len(llm.get_tokenizer()))
        rng = np.random.default_rng(7)
        tokens = blocks_per_prompt * GPU_BLOCK_SIZE - MAX_TOKENS
        batch = [
            TokensPrompt(prompt_token_ids=rng.integers(2, vocab, tokens).tolist()) for _ in range(n)
        ]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(batch, params, use_tqdm=False)
        return [o.request_id for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_waiting_requests_behind_max_num_seqs_are_not_looked_up_while_it_is_reached(
    model_dir: Path, calls: Calls
) -> None:
    """8 prompts, max_num_seqs 4: the scheduler stops at the running limit
    before it peeks at the next waiting request, so the four behind it are
    looked up first in a step where a slot is free, and at most one step
    before they run (there they may wait for GPU blocks that finished
    requests hold until their last stores are done)."""
    ids = generate_at_once(model_dir, blocks_per_prompt=10, n=8)
    print("\nlooked up:", dict(calls.looked_up), "\nscheduled:", dict(calls.scheduled))
    assert calls.looked_up[0] == ids[:4] == calls.scheduled[0]
    freed = calls.first(calls.scheduled, ids[4])
    assert freed > 1
    assert not any(calls.looked_up[step] for step in range(1, freed))
    for request in ids[4:]:
        ahead = calls.first(calls.scheduled, request) - calls.first(calls.looked_up, request)
        assert 0 <= ahead <= 1
    # the step boundary a manager sees: one take_events at the end of each
    # step, although vLLM's KV events are off here
    assert calls.taken == list(range(calls.step))


def test_waiting_request_without_gpu_blocks_is_looked_up_every_step_until_it_runs(
    model_dir: Path, calls: Calls
) -> None:
    """6 prompts of 20 blocks against vLLM's 63 free GPU blocks: three run;
    the fourth, at the head of the queue, is looked up (a touch of all its
    blocks, then a lookup) in every step while it waits for GPU blocks,
    after the running requests' decode is planned; the two behind it are not
    looked up until a step in which they run."""
    ids = generate_at_once(model_dir, blocks_per_prompt=20, n=6)
    print("\nlooked up:", dict(calls.looked_up), "\nscheduled:", dict(calls.scheduled))
    r0, r1, r2, r3, r4, r5 = ids
    assert calls.scheduled[0] == [r0, r1, r2]
    assert calls.looked_up[0] == [r0, r1, r2, r3]
    runs = calls.first(calls.scheduled, r3)
    assert calls.waits(r3) == runs >= MAX_TOKENS  # while r0..r2 decode
    assert all(calls.looked_up[step] == [r3] for step in range(1, runs))
    for request in (r4, r5):
        assert calls.first(calls.looked_up, request) == calls.first(calls.scheduled, request)
    # what the manager sees of it each step: a touch of its full blocks
    full_blocks = (20 * GPU_BLOCK_SIZE - MAX_TOKENS) // GPU_BLOCK_SIZE
    assert [n for _, r, n in calls.touches if r == r3] == [full_blocks] * (runs + 1)
