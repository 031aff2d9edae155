"""kvoffload's admin server inside vLLM's engine-core process (``admin_port``).

With ``"admin_port": P`` in the extra config, :meth:`KVOffloadSpec.get_manager
<kvoffload.vllm.KVOffloadSpec.get_manager>` hands vLLM's scheduler a
:class:`VLLMHostedManager` instead of the bare manager and serves it with
:func:`app.embedded.start_admin_server`: the admin API and ``/metrics`` on
``KVOFFLOAD_HOST:P`` (0: any free port), tokens and limits from the same
``KVOFFLOAD_*`` settings as ``kvoffload serve``. Commands land between the
scheduler's calls (:class:`~kvoffload.runtime.HostedManager`). With an OTLP
endpoint in the ``OTEL_*`` environment (:func:`app.telemetry.setup_telemetry`,
as for ``kvoffload serve``), admin actions and the transfer jobs finished in
this process go out as spans, policy switches and resets as log records (and
a warning when readers of the event log miss records, checked once per
scheduler step), and the ``/metrics`` catalogue as OTLP metrics.

When it stops: vLLM 0.11.2 tells the spec nothing at shutdown
(``OffloadingConnector`` inherits the base class's no-op ``shutdown()``), and
it freezes the engine's objects at start-up (``gc.freeze()``), so the engine
is never collected in-process either. What ``EngineCore.shutdown()`` does
free is the KV connector of each worker it runs in its own process, and with
it that worker's handler: the server stops when the first such handler goes.
Without one (tensor-parallel workers run in processes of their own) it stops
when vLLM drops the manager, or at interpreter exit, which, with the engine
core in a process of its own, is the engine's shutdown.

This module imports the web stack; only the spec imports it, and only for
``admin_port``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from app.embedded import AdminServer, StartupError, start_admin_server
from app.settings import ENV_PREFIX, Settings
from app.telemetry import Telemetry, setup_telemetry
from kvoffload.abstract import OffloadingEvent
from kvoffload.errors import ConfigError
from kvoffload.event_log import DEFAULT_CAPACITY, EventLog, EventRecord
from kvoffload.instrumentation.otel_metrics import OTelMetricsBridge
from kvoffload.instrumentation.tracing import TracingObserver
from kvoffload.manager import PolicyOffloadingManager
from kvoffload.policies import policy_class
from kvoffload.runtime.commands import CommandResult, EngineStoppedError, UnsupportedCommandError
from kvoffload.runtime.hosted import HostedConfig, HostedManager
from kvoffload.runtime.observer import EngineObserver, notify
from kvoffload.runtime.snapshot import EngineSnapshot, EngineState
from kvoffload.vllm import live

__all__ = ["VLLMHostedManager", "serve_admin"]

# A child of vLLM's logger: vLLM configures its handler only, so the line
# that says where the server listens shows among vLLM's own start-up lines.
logger = logging.getLogger(f"vllm.{__name__}")


class _SharedEventLog(EventLog):
    """The event log vLLM's ``take_events`` and the admin API's readers share:
    both read after a cursor, so a drain, which would take records from the
    other, is refused (409 ``not_supported`` through the API)."""

    def drain(self, limit: int | None = None, through_seq: int | None = None) -> list[EventRecord]:
        raise UnsupportedCommandError(
            "inside vLLM the event log also feeds vLLM's take_events (its KV events), so "
            "it is not drained; read it with GET /v1/events?after_seq=N, which removes nothing"
        )


class VLLMHostedManager(HostedManager):
    """The manager vLLM's scheduler drives while kvoffload's admin server serves it.

    ``manager`` must not have been called yet: its event log is replaced by one
    that is always on (``/v1/events`` reads it) and never drained, of
    ``event_log_capacity`` records (default: the replaced log's, else 10,000).
    :meth:`take_events` gives vLLM what the bare manager would have: the
    store and remove events since its last call when vLLM enabled KV events
    (``vllm_events``), else none. vLLM's scheduler calls it at the end of
    every step, KV events or not, so it also counts the steps (the ``step``
    of snapshots and ``applied_at_step`` of commands are vLLM's scheduler
    steps completed, as they are the runtime's engine steps) and calls
    ``on_step`` (the tracing observer's missed-records check; an exception
    is logged and dropped).
    """

    def __init__(
        self,
        manager: PolicyOffloadingManager,
        *,
        vllm_events: bool,
        observers: Sequence[EngineObserver] = (),
        on_step: Callable[[], object] | None = None,
        event_log_capacity: int | None = None,
    ) -> None:
        if event_log_capacity is None:
            old = manager.event_log
            event_log_capacity = old.capacity if old is not None else DEFAULT_CAPACITY
        self._log = manager.event_log = _SharedEventLog(event_log_capacity)
        self._steps = 0  # vLLM's scheduler steps completed: calls of take_events
        super().__init__(
            manager,
            description=f"vLLM engine core (pid {os.getpid()}), driven by its scheduler",
            observers=observers,
        )
        self.vllm_events = vllm_events
        self._on_step = on_step
        self._taken = 0  # seq of the last record vLLM's take_events got

    def _step(self) -> int:
        return self._steps

    def take_events(self) -> list[OffloadingEvent]:
        self._steps += 1
        if self._on_step is not None:
            notify(self._on_step)
        if not self.vllm_events:
            return []
        log = self._log
        if log.last_seq == self._taken:
            return []
        # a read, not a drain: /v1/events readers see every record too
        page = log.read(self._taken)
        self._taken = page.next_after_seq
        return [ev for r in page.records if (ev := r.to_offloading_event()) is not None]


class _EngineTarget:
    """What the server serves: the hosted manager, held weakly, so that the
    server keeps nothing of vLLM's engine alive. Once vLLM has dropped it the
    target reads as stopped and refuses commands (503 ``engine_stopped``)."""

    def __init__(self, hosted: VLLMHostedManager) -> None:
        self._hosted = weakref.ref(hosted)
        self.config: HostedConfig = hosted.config
        self.event_log: EventLog | None = hosted.event_log
        self._last = hosted.snapshot()

    @property
    def state(self) -> EngineState:
        hosted = self._hosted()
        return hosted.state if hosted is not None else "stopped"

    def snapshot(self) -> EngineSnapshot:
        hosted = self._hosted()
        if hosted is None:
            return self._last
        self._last = hosted.snapshot()
        return self._last

    def validate_policy(self, policy: str) -> None:
        policy_class(policy)  # a question about the class: no manager needed

    def switch_policy(
        self, policy: str, expected_version: int | None = None
    ) -> Future[CommandResult]:
        hosted = self._hosted()
        if hosted is None:  # not `if hosted`: an empty manager is falsy (len 0)
            return _engine_gone()
        return hosted.switch_policy(policy, expected_version)

    def reset(self) -> Future[CommandResult]:
        hosted = self._hosted()
        return hosted.reset() if hosted is not None else _engine_gone()

    def pause(self) -> Future[CommandResult]:
        hosted = self._hosted()
        return hosted.pause() if hosted is not None else _engine_gone()

    def resume(self) -> Future[CommandResult]:
        hosted = self._hosted()
        return hosted.resume() if hosted is not None else _engine_gone()


def _engine_gone() -> Future[CommandResult]:
    fut: Future[CommandResult] = Future()
    fut.set_exception(EngineStoppedError("vLLM's engine has shut down"))
    return fut


def serve_admin(
    manager: PolicyOffloadingManager,
    port: int,
    *,
    vllm_events: bool,
    workers: Sequence[object] = (),
    event_log_capacity: int | None = None,
) -> VLLMHostedManager:
    """Wrap ``manager`` for vLLM's scheduler and serve it on ``port`` until
    one of ``workers`` (the engine's handlers in this process) is freed, or
    vLLM drops the returned manager, or the interpreter exits (see the
    module doc), its event log of ``event_log_capacity`` records
    (:class:`VLLMHostedManager`). Transfer jobs finished in this process
    feed the server's transfer metrics, and OTLP spans where an endpoint is
    configured. Raises
    :class:`~kvoffload.errors.ConfigError` naming the port and the settings
    when the server cannot start (port in use, bad ``KVOFFLOAD_*`` setting,
    an OTLP protocol it cannot export over)."""
    where = f"admin_port {port} of kv_connector_extra_config"
    try:
        settings = Settings(port=port)
    except ValueError as exc:  # pydantic's ValidationError names each setting
        raise ConfigError(
            f"kvoffload admin server ({where}): the {ENV_PREFIX}* settings are invalid: {exc}"
        ) from None
    try:
        telemetry = setup_telemetry()
    except ConfigError as exc:
        raise ConfigError(f"kvoffload admin server ({where}): {exc}") from None
    # spans of transfer jobs; log records of applied commands and of records
    # readers missed (inert without a tracer or a logger provider)
    tracing = telemetry.tracing_observer()
    logs = telemetry.logger_provider is not None
    hosted = VLLMHostedManager(
        manager,
        vllm_events=vllm_events,
        observers=(tracing,) if logs else (),
        on_step=tracing.check_missed if logs else None,
        event_log_capacity=event_log_capacity,
    )
    tracing.watch_event_log(hosted.event_log)
    try:
        server = start_admin_server(
            _EngineTarget(hosted), settings, tracer_provider=telemetry.tracer_provider
        )
    except StartupError as exc:
        telemetry.shutdown()
        raise ConfigError(
            f"kvoffload admin server ({where}, host {settings.host!r} from {ENV_PREFIX}HOST): "
            f"{exc}; choose another admin_port, or 0 for any free port"
        ) from None
    listeners = [server.prometheus.transfer_finished]
    if telemetry.tracer_provider is not None:
        # no engine steps here: each job is a span of its own, sampled as a root
        listeners.append(tracing.transfer_finished)
    if telemetry.meter_provider is not None:
        OTelMetricsBridge(telemetry.meter_provider, server.registry)
    removes = [live.add_transfer_listener(fn) for fn in listeners]
    live.add_admin_server(server)
    # runs once, whoever calls it
    stop = weakref.finalize(hosted, _stop, server, removes, telemetry, tracing)
    for worker in workers:
        weakref.finalize(worker, stop)
    logger.info(
        "kvoffload admin API of this vLLM engine at %s (%s); workers in this process: %d",
        server.url,
        where,
        len(workers),
    )
    return hosted


def _stop(
    server: AdminServer,
    removes: Sequence[Callable[[], None]],
    telemetry: Telemetry,
    tracing: TracingObserver,
) -> None:
    for remove in removes:
        remove()
    # RuntimeError: the last reference went on the server's own thread, which
    # cannot join itself; stop() has told it to exit, and it does once this
    # returns
    with contextlib.suppress(RuntimeError):
        server.stop()
    tracing.close()  # a missed count still held back by the interval
    telemetry.shutdown()
