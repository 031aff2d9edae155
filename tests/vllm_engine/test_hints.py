"""kvoffload.vllm.HintingScheduler in a real vLLM 0.11.2 engine (issue 19):
vLLM's scheduler hints its whole waiting queue to kvoffload's manager, which
vLLM's connector alone never shows a spec (test_waiting.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload.errors import ConfigError

from .workload import GPU_BLOCK_SIZE, MAX_TOKENS, failing_engine_start, kvoffload_extra, make_llm

SCHEDULER = "kvoffload.vllm.HintingScheduler"
FACTOR = 2  # offloaded blocks of 64 tokens over vLLM's 32


@dataclass
class Seen:
    """At each ``schedule()``, right after the hints were brought up to date:
    the waiting requests (ids, offloaded blocks each) and the manager's window."""

    waiting: list[list[tuple[str, int]]] = field(default_factory=list)
    window: list[Any] = field(default_factory=list)
    #: the policy's own counts
    counts: list[dict[str, int]] = field(default_factory=list)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seen]:
    from kvoffload.vllm.scheduler import HintingScheduler

    record = Seen()
    hint = HintingScheduler._hint_waiting

    def recorded(self: Any) -> None:
        hint(self)
        record.waiting.append([(r.request_id, len(r.block_hashes) // FACTOR) for r in self.waiting])
        stats = self._manager.stats()
        record.window.append(stats.window)
        record.counts.append(dict(stats.policy_counters))

    monkeypatch.setattr(HintingScheduler, "_hint_waiting", recorded)
    yield record


def generate(model_dir: Path, extra: dict[str, Any], scheduler: str | None) -> list[list[int]]:
    """8 unrelated prompts of 10 GPU blocks in one ``generate`` (4 run at
    once), then the first 4 again: their prefixes come from the CPU tier."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(model_dir, kvoffload_extra(**extra), scheduler_cls=scheduler)
    try:
        vocab = min(llm.llm_engine.model_config.get_vocab_size(), len(llm.get_tokenizer()))
        rng = np.random.default_rng(11)
        tokens = 10 * GPU_BLOCK_SIZE - MAX_TOKENS
        batch = [
            TokensPrompt(prompt_token_ids=rng.integers(2, vocab, tokens).tolist()) for _ in range(8)
        ]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(batch + batch[:4], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_window_is_vllms_waiting_queue_at_every_step(model_dir: Path, seen: Seen) -> None:
    extra = {"num_cpu_blocks": 256, "block_size": 64, "eviction_policy": "lru", "lookahead": 6}
    generate(model_dir, extra, SCHEDULER)
    assert len(seen.window) > 10
    for waiting, window in zip(seen.waiting, seen.window, strict=True):
        ahead = waiting[:6]
        assert window.requests == len(ahead)
        assert window.uses == sum(n for _, n in ahead)
    # 12 requests, 4 run at once: 6 hinted at first (the lookahead), and the
    # ones behind the running limit stay hinted for every step they wait
    assert seen.window[0].requests == 6
    assert sum(1 for w in seen.waiting if len(w) >= 4) >= MAX_TOKENS
    assert seen.window[-1].requests == seen.window[-1].uses == 0


@pytest.mark.parametrize("policy", ["lru", "hkvarc"])
def test_hints_change_no_output(model_dir: Path, seen: Seen, policy: str) -> None:
    # 40 offloaded blocks of CPU tier for 12 requests of 4: hkvarc must choose
    extra = {"num_cpu_blocks": 40, "block_size": 64, "eviction_policy": policy}
    hinted = generate(model_dir, extra, SCHEDULER)
    assert max(w.requests for w in seen.window) > 0
    if policy == "hkvarc":  # it held hinted blocks out of kvarc's order
        assert seen.counts[-1]["deferred"] > 0
    assert hinted == generate(model_dir, extra, None)


def test_without_kvoffloads_spec_the_scheduler_refuses_to_start(model_dir: Path) -> None:
    with failing_engine_start(), pytest.raises(ConfigError) as info:
        make_llm(model_dir, None, scheduler_cls=SCHEDULER)
    assert "HintingScheduler hints kvoffload's manager" in str(info.value)
    assert '"spec_module_path": "kvoffload.vllm"' in str(info.value)
