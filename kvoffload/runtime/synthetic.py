"""A seeded synthetic workload: the embedded default, so a service shows live
numbers without any trace file.

Three kinds of request, mixed by weight:

- **chat** turns: a session starts from one of a few shared system prompts;
  each next turn repeats the previous prompt (minus its partial last block,
  which the new turn completes with different tokens) and appends new blocks.
  Reuse is a growing prefix, at a distance set by how many sessions are open.
- **document** questions: a document drawn from a Zipf popularity law, then a
  short question of fresh blocks. Popular documents are hot, the tail is cold.
- **one-off** prompts: nothing shared; they are the scans a policy must resist.

Block ids are chained like the Mooncake traces (an id names its block and the
whole prefix) and handed out in order of first appearance. The same config
and seed give the same requests on every pass and every platform
(:class:`random.Random` with an int seed is stable across Python versions).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvoffload._checks import is_finite_number, is_int
from kvoffload.runtime.workloads import Request, Workload, WorkloadError

__all__ = ["SyntheticConfig", "SyntheticWorkload"]


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """Shape of the synthetic workload. Ranges are inclusive ``(low, high)``
    counts of trace blocks.

    With the defaults, 10,000 requests make about 135k block accesses over
    64k unique blocks (prefix hit ratio 0.53 with an unbounded cache). An LRU
    cache of 1% of the unique blocks holds the system prompts and the hottest
    documents (hit ratio about 0.21), 5% about 0.33, 10% about 0.41 and 25%
    about 0.49 as it catches more of the chat history and the document tail.
    """

    seed: int = 0
    #: requests in one pass; ``None`` = endless
    num_requests: int | None = 10_000
    #: mean Poisson arrival rate
    requests_per_second: float = 20.0
    trace_block_size: int = 512
    # mix: relative weights of the three kinds
    chat_weight: float = 0.5
    document_weight: float = 0.3
    one_off_weight: float = 0.2
    # chats
    num_system_prompts: int = 4
    system_prompt_blocks: int = 4
    #: sessions open at once; a session's next turn comes about
    #: open_chats / chat share requests later, so this sets the reuse distance
    open_chats: int = 256
    #: mean turns per session (geometric)
    mean_turns: float = 5.0
    #: new blocks per turn (previous answer + new user message)
    turn_blocks: tuple[int, int] = (1, 4)
    # documents
    num_documents: int = 2000
    document_blocks: tuple[int, int] = (4, 24)
    zipf_exponent: float = 0.9
    question_blocks: tuple[int, int] = (1, 2)
    # one-off prompts
    one_off_blocks: tuple[int, int] = (1, 32)
    #: generated tokens per request
    output_tokens: tuple[int, int] = (16, 1024)

    def validate(self) -> None:
        """Raise :class:`WorkloadError` naming the first parameter out of range."""
        if not is_int(self.seed):
            raise WorkloadError(f"seed must be an integer, got {self.seed!r}")
        if self.num_requests is not None and (
            not is_int(self.num_requests) or self.num_requests < 0
        ):
            raise WorkloadError(
                f"num_requests must be an integer >= 0 or None, got {self.num_requests!r}"
            )
        if not is_finite_number(self.requests_per_second) or not self.requests_per_second > 0:
            raise WorkloadError(
                f"requests_per_second must be a finite number > 0, got {self.requests_per_second!r}"
            )
        if not is_int(self.trace_block_size) or self.trace_block_size <= 0:
            raise WorkloadError(
                f"trace_block_size must be an integer > 0, got {self.trace_block_size!r}"
            )
        weights = (self.chat_weight, self.document_weight, self.one_off_weight)
        if (
            any(not is_finite_number(w) or not w >= 0 for w in weights)
            or not 0 < sum(weights) < math.inf
        ):
            raise WorkloadError(
                "mix weights must be finite numbers >= 0 with a positive, finite sum, got "
                f"chat={self.chat_weight!r}, document={self.document_weight!r}, "
                f"one_off={self.one_off_weight!r}"
            )
        for name in ("num_system_prompts", "open_chats", "num_documents"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise WorkloadError(f"{name} must be an integer >= 1, got {value!r}")
        if not is_int(self.system_prompt_blocks) or self.system_prompt_blocks < 0:
            raise WorkloadError(
                f"system_prompt_blocks must be an integer >= 0, got {self.system_prompt_blocks!r}"
            )
        # bounded above: a mean of 1e12 turns takes for ever to draw, and an
        # exponent of 200 overflows rank ** exponent
        if not is_finite_number(self.mean_turns) or not 1 <= self.mean_turns <= 10_000:
            raise WorkloadError(
                f"mean_turns must be a number from 1 to 10000, got {self.mean_turns!r}"
            )
        if not is_finite_number(self.zipf_exponent) or not 0 <= self.zipf_exponent <= 10:
            raise WorkloadError(
                f"zipf_exponent must be a number from 0 to 10, got {self.zipf_exponent!r}"
            )
        for name in (
            "turn_blocks",
            "document_blocks",
            "question_blocks",
            "one_off_blocks",
            "output_tokens",
        ):
            bounds = getattr(self, name)
            if (
                not isinstance(bounds, tuple)
                or len(bounds) != 2
                or not all(is_int(b) for b in bounds)
                or not 1 <= bounds[0] <= bounds[1]
            ):
                raise WorkloadError(
                    f"{name} must be a (low, high) tuple of integers with 1 <= low <= high, "
                    f"got {bounds!r}"
                )

    @property
    def mix(self) -> dict[str, float]:
        """The normalised fraction of each kind of request."""
        total = self.chat_weight + self.document_weight + self.one_off_weight
        return {
            "chat": self.chat_weight / total,
            "document": self.document_weight / total,
            "one_off": self.one_off_weight / total,
        }


class SyntheticWorkload(Workload):
    """Requests drawn from a :class:`SyntheticConfig`; every pass is identical."""

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config if config is not None else SyntheticConfig()
        self.config.validate()
        self.trace_block_size = self.config.trace_block_size

    @property
    def len_hint(self) -> int | None:
        return self.config.num_requests

    def __iter__(self) -> Iterator[Request]:
        return _Generator(self.config).requests()

    def describe(self) -> str:
        c = self.config
        mix = c.mix
        length = "endless" if c.num_requests is None else f"{c.num_requests} requests"
        return (
            f"synthetic (seed {c.seed}): {length} at {c.requests_per_second:g} req/s; "
            f"{mix['chat']:.0%} chat turns over {c.num_system_prompts} system prompts "
            f"({c.open_chats} open sessions, {c.mean_turns:g} turns on average), "
            f"{mix['document']:.0%} questions on {c.num_documents} Zipf({c.zipf_exponent:g}) "
            f"documents, {mix['one_off']:.0%} one-off prompts; "
            f"{c.trace_block_size}-token blocks"
        )


class _Generator:
    """The state of one pass: open chat sessions and the ids handed out so far."""

    def __init__(self, config: SyntheticConfig) -> None:
        self.c = config
        self.rng = random.Random(config.seed)
        self.next_id = 0
        self.system_prompts: dict[int, tuple[int, ...]] = {}
        self.documents: dict[int, tuple[int, ...]] = {}
        #: open sessions: (prompt of the last turn, turns left)
        self.chats: list[tuple[tuple[int, ...], int]] = []
        weights = [
            1.0 / (rank**config.zipf_exponent) for rank in range(1, config.num_documents + 1)
        ]
        self.zipf_cdf = list(itertools.accumulate(weights))
        mix = config.mix
        self.kinds = ("chat", "document", "one_off")
        self.kind_cdf = list(itertools.accumulate(mix[k] for k in self.kinds))

    def fresh(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def between(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def requests(self) -> Iterator[Request]:
        c = self.c
        rng = self.rng
        now = 0.0
        counter = itertools.count() if c.num_requests is None else range(c.num_requests)
        for request_id in counter:
            kind = self.kinds[
                min(bisect.bisect_right(self.kind_cdf, rng.random()), len(self.kinds) - 1)
            ]
            if kind == "chat":
                block_ids = self.chat_turn()
            elif kind == "document":
                block_ids = self.document_question()
            else:
                block_ids = self.fresh(self.between(c.one_off_blocks))
            # the last block is partial, as in the traces
            input_length = (len(block_ids) - 1) * c.trace_block_size + rng.randint(
                1, c.trace_block_size
            )
            yield Request(
                request_id=request_id,
                arrival_time=now,
                block_ids=block_ids,
                input_length=input_length,
                output_length=self.between(c.output_tokens),
                kind=kind,
            )
            now += rng.expovariate(c.requests_per_second)

    def chat_turn(self) -> tuple[int, ...]:
        c = self.c
        rng = self.rng
        # Sessions are kept at ``open_chats``: a finished one is replaced by a
        # new one, so a turn comes back about every open_chats / chat share
        # requests and the reuse distance is set by one parameter.
        if len(self.chats) < c.open_chats:
            system = rng.randrange(c.num_system_prompts)
            if system not in self.system_prompts:
                self.system_prompts[system] = self.fresh(c.system_prompt_blocks)
            prompt = self.system_prompts[system] + self.fresh(self.between(c.turn_blocks))
            turns_left = self.turns()
            slot = len(self.chats)
            self.chats.append((prompt, turns_left))  # updated below
        else:
            slot = rng.randrange(len(self.chats))
            previous, turns_left = self.chats[slot]
            # the previous prompt's partial last block is completed by new
            # tokens, so its id changes: the shared prefix stops before it
            prompt = previous[:-1] + self.fresh(self.between(c.turn_blocks))
        turns_left -= 1
        if turns_left <= 0:
            # swap-remove: order of sessions does not matter, picks are random
            self.chats[slot] = self.chats[-1]
            self.chats.pop()
        else:
            self.chats[slot] = (prompt, turns_left)
        return prompt

    def turns(self) -> int:
        """A geometric number of turns >= 1 with mean ``mean_turns``."""
        stop = 1.0 / self.c.mean_turns
        n = 1
        while self.rng.random() >= stop:
            n += 1
        return n

    def document_question(self) -> tuple[int, ...]:
        c = self.c
        total = self.zipf_cdf[-1]
        doc = min(
            bisect.bisect_right(self.zipf_cdf, self.rng.random() * total), c.num_documents - 1
        )
        if doc not in self.documents:
            self.documents[doc] = self.fresh(self.between(c.document_blocks))
        return self.documents[doc] + self.fresh(self.between(c.question_blocks))
