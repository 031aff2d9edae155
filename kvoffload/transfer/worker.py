"""Routing transfer jobs to handlers (vLLM ``kv_offload.worker.worker``)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from kvoffload.abstract import LoadStoreSpec
from kvoffload.errors import TransferError

__all__ = [
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
    "TransferType",
]

logger = logging.getLogger(__name__)

#: ``(src_spec, dst_spec)``: copy the blocks named by src into those named by dst.
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
#: ``(job_id, success)``.
TransferResult = tuple[int, bool]
TransferType = tuple[str, str]


def _transfer_type(spec: Any) -> TransferType:
    """The media of a ``(src, dst)`` spec pair; :class:`TransferError` unless
    ``spec`` is two specs whose ``medium()`` answers a string."""
    try:
        src, dst = spec
        media = (src.medium(), dst.medium())
    except Exception as exc:
        reason = str(exc)
    else:
        if isinstance(media[0], str) and isinstance(media[1], str):
            return media
        reason = f"medium() answered {media[0]!r}, {media[1]!r}"
    if isinstance(spec, tuple | list):
        names = [type(s).__name__ for s in spec[:3]] + (["..."] if len(spec) > 3 else [])
        got = f"{type(spec).__name__} ({', '.join(names)})"
    else:
        got = type(spec).__name__
    raise TransferError(
        "a spec pair must be a (src, dst) tuple of two LoadStoreSpecs whose medium() "
        f"is a string, got a {got}: {reason}"
    )


class OffloadingHandler(ABC):
    """Runs transfer jobs asynchronously and reports the ones that finished."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start a job. ``False`` if it could not be submitted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs that finished since the last call, each reported once."""


class OffloadingWorker:
    """Routes each job to the handler registered for its ``(src, dst)`` media."""

    def __init__(self) -> None:
        self.handlers: list[OffloadingHandler] = []
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}
        self._pending: set[int] = set()

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        """Send jobs from ``src_cls``'s medium to ``dst_cls``'s to ``handler``.
        One handler may serve several directions; it is polled once."""
        transfer_type = (src_cls.medium(), dst_cls.medium())
        if transfer_type in self.transfer_type_to_handler:
            raise TransferError(
                f"a handler is already registered for {transfer_type[0]}->{transfer_type[1]}"
            )
        if not any(h is handler for h in self.handlers):
            self.handlers.append(handler)
        self.transfer_type_to_handler[transfer_type] = handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a job. Returns ``False`` (and logs why) if its handler
        raised or refused. A malformed spec pair, an unregistered medium pair
        or a job id still in flight is a caller bug and raises
        :class:`TransferError`."""
        transfer_type = _transfer_type(spec)
        handler = self.transfer_type_to_handler.get(transfer_type)
        if handler is None:
            known = ", ".join(f"{s}->{d}" for s, d in self.transfer_type_to_handler) or "none"
            raise TransferError(
                f"no handler registered for {transfer_type[0]}->{transfer_type[1]} (registered: {known})"
            )
        if job_id in self._pending:
            raise TransferError(f"job id {job_id} is still in flight; job ids must be unique")
        try:
            success = handler.transfer_async(job_id, spec)
        except Exception:
            logger.warning("transfer %d (%s->%s) raised", job_id, *transfer_type, exc_info=True)
            return False
        if not success:
            logger.warning(
                "transfer %d (%s->%s) was refused by its handler", job_id, *transfer_type
            )
            return False
        self._pending.add(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, across all handlers."""
        finished: list[TransferResult] = []
        for handler in self.handlers:
            finished.extend(handler.get_finished())
        for job_id, _ in finished:
            self._pending.discard(job_id)
        return finished
