"""An in-memory :class:`OffloadingHandler` for tests and demos (no torch).

It keeps block contents as ``bytes`` in two dicts, one entry per GPU block and
one per CPU-mirror row (sub-block), and pairs rows with the same
:func:`~kvoffload.transfer.block_map.plan_transfer` as the real handler, so a
job it accepts is one the CPU/GPU handler accepts too. Failures and delays can
be injected to exercise the callers' error paths:

- ``refuse_all`` / :meth:`refuse_job`: :meth:`transfer_async` returns ``False``;
- :meth:`fail_job` / ``failure_rate`` (seeded): the job is reported
  ``(job_id, False)`` and writes nothing;
- ``delay_polls`` / :meth:`delay_job`: the job is reported only after that many
  :meth:`get_finished` calls that did not report it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload._checks import check_int, is_int, is_number
from kvoffload.errors import ConfigError
from kvoffload.transfer.block_map import TransferPlan, admit_job
from kvoffload.transfer.worker import OffloadingHandler, TransferResult, TransferSpec

logger = logging.getLogger(__name__)

__all__ = ["InMemoryOffloadingHandler"]


@dataclass(slots=True)
class _PendingJob:
    ok: bool
    polls_left: int
    # (destination dict is GPU, row -> contents), captured at submit: a real
    # copy engine reads the source in stream order, not when polled.
    to_gpu: bool
    writes: dict[int, bytes | None]


class InMemoryOffloadingHandler(OffloadingHandler):
    """A fake GPU<->CPU handler storing rows as ``bytes``.

    ``gpu_blocks[i]`` holds GPU block ``i``; ``cpu_rows[b*factor + j]`` holds
    sub-block ``j`` of CPU block ``b``. Rows never written are absent. With
    ``strict=True`` a job that would read an absent source row is refused (the
    data it would copy is undefined on a real device); with ``strict=False``
    the destination row is made absent too.

    Postconditions: a successful job's destination rows equal its source rows
    as they were at submit; a failed job changes nothing; every accepted job is
    reported exactly once.
    """

    def __init__(
        self,
        *,
        block_size_factor: int = 1,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int | None = None,
        fail_job_ids: Iterable[int] = (),
        refuse_job_ids: Iterable[int] = (),
        refuse_all: bool = False,
        failure_rate: float = 0.0,
        delay_polls: int = 0,
        seed: int = 0,
        strict: bool = True,
    ) -> None:
        """Settings of the wrong type or out of range raise
        :class:`~kvoffload.errors.ConfigError`: counts are ints
        (``block_size_factor`` and block counts >= 1, ``delay_polls`` >= 0),
        ``failure_rate`` a number in [0, 1], flags bools."""
        check_int("block_size_factor", block_size_factor, 1)
        for name, count in (("num_gpu_blocks", num_gpu_blocks), ("num_cpu_blocks", num_cpu_blocks)):
            if count is not None and (not is_int(count) or count < 1):
                raise ConfigError(f"{name} must be None or an int >= 1, got {count!r}")
        if not (is_number(failure_rate) and 0.0 <= failure_rate <= 1.0):
            raise ConfigError(f"failure_rate must be a number in [0, 1], got {failure_rate!r}")
        check_int("delay_polls", delay_polls, 0)
        if not is_int(seed):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        for name, flag in (("refuse_all", refuse_all), ("strict", strict)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        self.block_size_factor = block_size_factor
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.gpu_blocks: dict[int, bytes] = {}
        self.cpu_rows: dict[int, bytes] = {}
        self.fail_job_ids: set[int] = set(fail_job_ids)
        self.refuse_job_ids: set[int] = set(refuse_job_ids)
        self.refuse_all = refuse_all
        self.failure_rate = failure_rate
        self.delay_polls = delay_polls
        self.strict = strict
        self._job_delays: dict[int, int] = {}
        self._rng = random.Random(seed)
        self._pending: dict[int, _PendingJob] = {}
        #: Every accepted job, in submit order: ``(job_id, direction, rows)``.
        self.submitted: list[tuple[int, str, int]] = []

    # -- injection ------------------------------------------------------

    def fail_job(self, job_id: int) -> None:
        """Report ``job_id`` as failed when it is next submitted."""
        self.fail_job_ids.add(job_id)

    def refuse_job(self, job_id: int) -> None:
        """Refuse the next submission of ``job_id`` (``transfer_async``
        returns ``False``)."""
        self.refuse_job_ids.add(job_id)

    def delay_job(self, job_id: int, polls: int) -> None:
        """Hold ``job_id`` back for ``polls`` calls of :meth:`get_finished`
        (an int >= 0, else :class:`~kvoffload.errors.ConfigError`)."""
        check_int("polls", polls, 0)
        self._job_delays[job_id] = polls

    # -- contents -------------------------------------------------------

    def write_gpu_block(self, block_id: int, data: bytes) -> None:
        """Set GPU block ``block_id``'s contents (the engine "computing" it)."""
        self.gpu_blocks[block_id] = bytes(data)

    def read_gpu_block(self, block_id: int) -> bytes | None:
        """GPU block contents, ``None`` if never written."""
        return self.gpu_blocks.get(block_id)

    def read_cpu_block(self, block_id: int) -> list[bytes | None]:
        """The ``factor`` sub-blocks of CPU block ``block_id``."""
        base = block_id * self.block_size_factor
        return [self.cpu_rows.get(base + j) for j in range(self.block_size_factor)]

    @property
    def num_in_flight(self) -> int:
        """Jobs accepted and not yet reported."""
        return len(self._pending)

    # -- protocol -------------------------------------------------------

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Accept a job unless refused (injected), malformed, still in flight,
        or (``strict``) reading unwritten rows; ``False`` is logged."""
        if self.refuse_all or job_id in self.refuse_job_ids:
            self.refuse_job_ids.discard(job_id)
            logger.info("transfer %d refused (injected)", job_id)
            return False
        plan = admit_job(
            job_id,
            spec,
            self.block_size_factor,
            self._pending,
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
        )
        if plan is None:
            return False
        writes = self._snapshot(plan)
        if writes is None:
            logger.warning("transfer %d refused: it reads rows that were never written", job_id)
            return False
        ok = job_id not in self.fail_job_ids
        self.fail_job_ids.discard(job_id)
        if ok and self.failure_rate and self._rng.random() < self.failure_rate:
            ok = False
        delay = self._job_delays.pop(job_id, self.delay_polls)
        self._pending[job_id] = _PendingJob(ok, delay, plan.direction == "load", writes)
        self.submitted.append((job_id, plan.direction, plan.copy.num_rows))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs whose delay ran out, in submit order; successful ones write
        their destination rows now."""
        done: list[TransferResult] = []
        for job_id, job in self._pending.items():
            if job.polls_left > 0:
                job.polls_left -= 1
                continue
            if job.ok:
                target = self.gpu_blocks if job.to_gpu else self.cpu_rows
                for row, data in job.writes.items():
                    if data is None:
                        target.pop(row, None)
                    else:
                        target[row] = data
            else:
                logger.info("transfer %d failed (injected)", job_id)
            done.append((job_id, job.ok))
        for job_id, _ in done:
            del self._pending[job_id]
        return done

    def _snapshot(self, plan: TransferPlan) -> dict[int, bytes | None] | None:
        source = self.gpu_blocks if plan.direction == "store" else self.cpu_rows
        writes: dict[int, bytes | None] = {}
        for s, d in zip(plan.copy.src.tolist(), plan.copy.dst.tolist(), strict=True):
            data = source.get(s)
            if data is None and self.strict:
                return None
            writes[d] = data
        return writes
