"""A vLLM scheduler that hints its waiting queue to kvoffload's manager.

vLLM 0.11.2's offloading connector shows a spec one waiting request at most
(docs/vllm.md, "Waiting requests"), too little for foresight. The scheduler
holds the whole queue, and ``scheduler_cls`` lets a deployment choose a
subclass of it::

    LLM(..., scheduler_cls="kvoffload.vllm.HintingScheduler",
        kv_transfer_config=KVTransferConfig(..., kv_connector_extra_config={
            "spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
            "num_cpu_blocks": 4096, "eviction_policy": "hkvarc", "lookahead": 64}))

:class:`HintingScheduler` is vLLM's ``Scheduler`` unchanged except that each
``schedule()`` first brings the manager's hint window up to date with the
first ``lookahead`` requests of ``self.waiting``, in queue order, hinting
each with the offloaded block hashes the connector will name for it. This
module imports vLLM; :mod:`kvoffload.vllm` loads it on first access.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvoffload.abstract import SupportsHints
from kvoffload.errors import ConfigError
from kvoffload.vllm.config import SPEC_MODULE_PATH, SPEC_NAME, lookahead

__all__ = ["HintingScheduler"]


class HintingScheduler(Scheduler):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's scheduler, telling kvoffload's manager which blocks the waiting
    requests will use (``lookahead`` of them, from the extra config).

    A request joins the window when it is among the first ``lookahead``
    waiting ones at the start of a ``schedule()``, and leaves it at the start
    of the first ``schedule()`` it is no longer waiting in (it was scheduled,
    finished or aborted), so it is hinted while the step that schedules it
    looks it up. The window keeps the queue's order: after a preemption puts
    a request back at the head, the whole window is hinted again in order.
    Needs kvoffload's spec (``spec_module_path`` ``kvoffload.vllm``); any other
    connector raises :class:`~kvoffload.errors.ConfigError` at start.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kv = self.vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config) if kv is not None else {}
        connector: Any = getattr(getattr(self, "connector", None), "connector_scheduler", None)
        manager = getattr(connector, "manager", None)
        if (
            extra.get("spec_module_path") != SPEC_MODULE_PATH
            or extra.get("spec_name") != SPEC_NAME
            or not isinstance(manager, SupportsHints)
        ):
            raise ConfigError(
                f"{type(self).__name__} hints kvoffload's manager: configure "
                f'kv_connector="OffloadingConnector" with kv_connector_extra_config '
                f'{{"spec_name": "{SPEC_NAME}", "spec_module_path": "{SPEC_MODULE_PATH}", ...}} '
                f"(got kv_transfer_config {kv!r})"
            )
        self._manager: SupportsHints = manager
        self._factor: int = connector.block_size_factor
        self._lookahead: int = lookahead(extra)
        #: hinted request ids in hint order, with their tickets
        self._hinted: dict[str, int] = {}

    def schedule(self) -> Any:
        self._hint_waiting()
        return super().schedule()

    def _hint_waiting(self) -> None:
        manager, hinted = self._manager, self._hinted
        waiting = list(islice(self.waiting, self._lookahead))
        ids = {r.request_id: r for r in waiting}
        for rid in [rid for rid in hinted if rid not in ids]:
            manager.unhint(hinted.pop(rid))
        order = [r.request_id for r in waiting]
        if list(hinted) != order[: len(hinted)]:  # a request came back ahead of them
            for ticket in hinted.values():
                manager.unhint(ticket)
            hinted.clear()
        k = self._factor
        for rid in order[len(hinted) :]:
            hinted[rid] = manager.hint(ids[rid].block_hashes[k - 1 :: k])
