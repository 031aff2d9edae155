"""hkvarc against issue 19's targets on the shared traces, cell by cell, so
that a regression fails (``bench/lookahead.py`` prints the whole grid, the
generator's workloads and the baseline measured; ``docs/policies.md`` has
every figure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kvoffload.policies as policies
from kvoffload.replay import parse_capacity, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import lookahead  # bench/lookahead.py: the issue's figures and the workloads

#: the one cell hkvarc misses, and its hits there (a ratio of .3512): the
#: issue's baseline is .3519 (docs/policies.md: every block lost there against
#: Belady was evicted unhinted, and the ones used again are next used 2048 to
#: 8192 requests later, beyond what the window shows); it must not get worse
SHORT = {("conversation", "5%", 2048): 101_315}


@pytest.mark.parametrize("capacity", lookahead.CAPACITIES)
@pytest.mark.parametrize("name", lookahead.SHARED)
def test_hkvarc_meets_the_issues_targets_on_the_shared_traces(name: str, capacity: str) -> None:
    trace = lookahead.load(name)
    blocks = parse_capacity(capacity, trace.unique_blocks)
    kvarc = replay(trace, policy="kvarc", capacity=blocks)
    for w, published in zip(lookahead.WS, lookahead.ISSUE_BASELINE[name, capacity], strict=True):
        ours = replay(trace, policy="hkvarc", capacity=blocks, lookahead=w)
        ratio, cell = ours.prefix_hit_ratio, (name, capacity, w)
        if w == 0:
            assert ours.hit_blocks == kvarc.hit_blocks, "without hints hkvarc is kvarc"
        assert ratio >= kvarc.prefix_hit_ratio - lookahead.KVARC_SLACK, cell
        if cell in SHORT:
            assert ours.hit_blocks >= SHORT[cell], (cell, ratio)
        else:
            assert ratio >= published - lookahead.ROUNDING, (cell, ratio)
        listed = lookahead.LISTED.get(cell)
        if listed is not None:
            assert ratio >= listed - lookahead.ROUNDING, (cell, ratio)


def test_vllm_docs_figures_of_a_short_window_are_the_replays() -> None:
    """docs/vllm.md says what one request of lookahead (what vLLM's connector
    shows a spec) and 64 (HintingScheduler's default) are worth: hkvarc
    minus kvarc at 5% / 10%, conversation then synthetic. Read from the
    page, so that the page cannot drift from the replay (it once did)."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    passage = text[text.index("measures what that is worth") :][:700]
    figures = [float(f) for f in re.findall(r"[+-]0\.\d{4}", passage)]
    assert len(figures) == 8, passage
    measured = []
    for w in (1, 64):
        for name in lookahead.SHARED:
            trace = lookahead.load(name)
            for capacity in lookahead.CAPACITIES:
                blocks = parse_capacity(capacity, trace.unique_blocks)
                kvarc = replay(trace, policy="kvarc", capacity=blocks).prefix_hit_ratio
                ours = replay(trace, policy="hkvarc", capacity=blocks, lookahead=w)
                measured.append(round(ours.prefix_hit_ratio - kvarc, 4))
    assert measured == figures


@pytest.mark.parametrize("name", list(lookahead.GENERATED))
def test_hkvarc_is_at_or_above_the_baseline_and_kvarc_on_our_workloads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's "at or above the baseline in 95 of 96 grid cells" and
    docs/policies.md's "at or above kvarc in all 96": the 72 generator cells
    (the one miss is a shared-trace cell, above), against the baseline
    measured here; only a full bench run checked them before."""
    # the bench registers its baseline policy: in a registry of this test's own
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))
    for c in lookahead.grid(name, lookahead.load(name), lookahead.WS):
        cell = (c.workload, c.capacity, c.lookahead)
        assert c.hkvarc >= c.baseline, (cell, c.hkvarc, c.baseline)
        assert c.hkvarc >= c.kvarc, (cell, c.hkvarc, c.kvarc)
        if c.lookahead == 0:
            assert c.hits[0] == c.hits[1], cell  # exactly kvarc without hints
