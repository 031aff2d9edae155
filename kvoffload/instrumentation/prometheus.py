"""Prometheus metrics for kvoffload (``prometheus_client`` only).

Three pieces, each registered on a :class:`~prometheus_client.CollectorRegistry`
the caller passes (library code never touches the global ``REGISTRY``):

- :class:`KVOffloadCollector` reads an immutable snapshot
  (:class:`~kvoffload.runtime.snapshot.EngineSnapshot` or
  :class:`~kvoffload.stats.ManagerStats`) at *scrape* time: nothing is paid on
  the hot path for counters and gauges the manager already keeps.
- :class:`PrometheusObserver` is an
  :class:`~kvoffload.runtime.observer.EngineObserver` that records what only
  exists as it happens: transfer jobs (count, blocks, bytes, duration and
  size histograms) and step durations.
- :class:`ApiMetrics` counts and times the admin API's requests, as the
  service's middleware (``app.request_metrics``) records them.

Every family, its type, labels and help text come from
:data:`~kvoffload.instrumentation.catalogue.METRICS`.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeAlias

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from kvoffload._version import __version__
from kvoffload.errors import ConfigError
from kvoffload.event_log import EventLog, EventLogStats
from kvoffload.instrumentation.catalogue import (
    DIRECTIONS,
    METRICS,
    METRICS_BY_NAME,
    PROMPT_TOKEN_OUTCOMES,
    TRANSFER_OUTCOMES,
    MetricSource,
    MetricSpec,
)
from kvoffload.runtime.observer import EngineObserver, TransferRecord
from kvoffload.runtime.snapshot import EngineSnapshot
from kvoffload.stats import STORE_OUTCOMES, ManagerStats
from kvoffload.table import IMPLEMENTATION

__all__ = [
    "ApiMetrics",
    "ConfigLabelValue",
    "ExemplarSource",
    "KVOffloadCollector",
    "PrometheusObserver",
    "SnapshotSource",
    "config_labels",
]

#: what the collector calls at scrape time; must be cheap and thread-safe
SnapshotSource: TypeAlias = Callable[[], EngineSnapshot | ManagerStats]
ConfigLabelValue: TypeAlias = str | int | float | bool | None

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: the engine does its job: as /readyz (a non-looping replay that finished is
#: not an engine that stopped, and must not page anyone)
_RUNNING_STATES = frozenset({"running", "paused", "finished"})


#: label values and value of one sample
Sample: TypeAlias = tuple[Sequence[str], float]
#: a histogram bucket: its le, its cumulative count, and maybe an exemplar
Bucket: TypeAlias = tuple[str, float] | tuple[str, float, Exemplar]


def _family(name: str, labels: Sequence[str] = (), samples: Iterable[Sample] = ()) -> Metric:
    """The catalogue's family ``name`` holding ``samples`` (counters and gauges)."""
    spec = METRICS_BY_NAME[name]
    fam: CounterMetricFamily | GaugeMetricFamily
    if spec.type == "counter":
        fam = CounterMetricFamily(spec.base_name, spec.help, labels=labels)
    elif spec.type == "gauge":
        fam = GaugeMetricFamily(spec.name, spec.help, labels=labels)
    else:
        raise TypeError(f"{name} is a {spec.type}: build it with HistogramMetricFamily")
    for label_values, value in samples:
        fam.add_metric(label_values, value)
    return fam


def _scalar(name: str, value: float) -> Metric:
    return _family(name, (), [((), value)])


def _empty_family(spec: MetricSpec) -> Metric:
    """A sample-less family, for ``describe()``."""
    if spec.type == "histogram":
        return HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
    return _family(spec.name, spec.labels)


def _empty_families(*sources: MetricSource) -> list[Metric]:
    """The sample-less families of the catalogue's metrics from ``sources``
    (what a collector yielding them says in ``describe()``)."""
    return [_empty_family(spec) for spec in METRICS if spec.source in sources]


def _label_value(value: ConfigLabelValue) -> str:
    if value is None:
        return "none"  # not "": Prometheus reads an empty label as no label
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def config_labels(config: object) -> dict[str, ConfigLabelValue]:
    """The scalar fields of a dataclass (e.g. ``engine.config``) as a mapping
    for ``config_info``. Nested or container fields are left out: they would
    make unbounded label values."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ConfigError(f"config_labels needs a dataclass instance, got {type(config).__name__}")
    out: dict[str, ConfigLabelValue] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None or isinstance(value, str | int | float | bool):
            out[f.name] = value
    return out


class KVOffloadCollector:
    """A scrape-time collector over a snapshot source.

    Args:
        snapshot: returns the current :class:`EngineSnapshot` (e.g.
            ``engine.snapshot``) or :class:`ManagerStats` (e.g.
            ``manager.stats``, when the manager's owning thread is the one
            scraping). Called once per scrape, from the scraping thread.
        registry: registered on it when given (never the global one by default).
        config_info: configuration exposed as labels of
            ``kvoffload_config_info``; see :func:`config_labels`. Keys must be
            valid Prometheus label names, values scalars.
        event_log: read at each scrape for the ``kvoffload_events_*``
            metrics (e.g. ``engine.event_log``): drains and reads from other
            threads change its counts between snapshots. Without it they come
            from the snapshot.

    Counters keyed by list (evictions, ghost hits) keep every list ever seen,
    with its last value, so they stay monotonic across policy switches;
    gauges of policy lists follow the current policy only.
    """

    def __init__(
        self,
        snapshot: SnapshotSource,
        *,
        registry: CollectorRegistry | None = None,
        config_info: Mapping[str, ConfigLabelValue] | None = None,
        event_log: EventLog | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._event_log = event_log
        self._config = self._check_config(config_info or {})
        self._lock = threading.Lock()
        self._seen_evictions: dict[str, int] = {}
        self._seen_ghost_hits: dict[str, int] = {}
        if registry is not None:
            registry.register(self)

    @staticmethod
    def _check_config(config: Mapping[str, ConfigLabelValue]) -> dict[str, str]:
        out: dict[str, str] = {}
        for key, value in config.items():
            if not isinstance(key, str) or not _LABEL_NAME.match(key) or key.startswith("__"):
                raise ConfigError(
                    f"config_info key {key!r} is not a valid Prometheus label name "
                    "([a-zA-Z_][a-zA-Z0-9_]*, not starting with '__')"
                )
            if value is not None and not isinstance(value, str | int | float | bool):
                raise ConfigError(
                    f"config_info[{key!r}] must be a scalar, got {type(value).__name__}; "
                    "flatten it or leave it out (see config_labels)"
                )
            out[key] = _label_value(value)
        return out

    def describe(self) -> Iterable[Metric]:
        """Every family this collector may yield, without samples (lets the
        registry reject a second collector exposing the same names)."""
        return _empty_families("manager", "events", "runtime", "static")

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if isinstance(snap, EngineSnapshot):
            stats = snap.manager
            version = snap.policy_version
        else:
            stats = snap
            version = stats.counters.policy_switches + 1
        yield from self._manager_metrics(stats, version)
        yield from self._static_metrics()
        events = self._event_log.stats() if self._event_log is not None else stats.events
        if events is not None:
            yield from self._event_metrics(events)
        if isinstance(snap, EngineSnapshot):
            yield from self._runtime_metrics(snap)

    # -- pieces ---------------------------------------------------------------

    def _manager_metrics(self, s: ManagerStats, version: int) -> Iterator[Metric]:
        c = s.counters
        bs = s.block_size
        yield _scalar("kvoffload_lookups_total", c.lookups)
        yield _scalar("kvoffload_lookup_blocks_total", c.lookup_blocks)
        yield _scalar("kvoffload_lookup_hit_blocks_total", c.hit_blocks)
        yield _scalar("kvoffload_lookup_tokens_total", c.lookup_blocks * bs)
        yield _scalar("kvoffload_lookup_hit_tokens_total", c.hit_blocks * bs)
        yield _scalar("kvoffload_load_blocks_total", c.load_blocks)
        yield _scalar("kvoffload_load_completed_blocks_total", c.load_completed_blocks)
        yield _scalar("kvoffload_store_prepared_blocks_total", c.store_prepared_blocks)
        yield _family(
            "kvoffload_store_blocks_total",
            ("outcome",),
            [((o,), c.store_blocks.get(o, 0)) for o in STORE_OUTCOMES],
        )
        yield _scalar("kvoffload_store_rejections_total", c.rejected_stores)
        yield _scalar("kvoffload_touched_blocks_total", c.touches)
        yield _scalar("kvoffload_policy_switches_total", c.policy_switches)

        # Resident lists can be victims, ghost lists can be hit: pre-create
        # both at 0 for the current policy so rate() has a series from the
        # start; remember every list ever seen so counters survive a switch.
        resident, ghosts = s.resident_lists, s.ghost_lists
        with self._lock:
            for lst in resident:
                self._seen_evictions.setdefault(lst, 0)
            self._seen_evictions.update(c.evictions)
            self._seen_ghost_hits.update(c.ghost_hits)
            evictions = sorted(self._seen_evictions.items())
            ghost_hits = sorted(self._seen_ghost_hits.items())
        yield _family("kvoffload_evictions_total", ("list",), [((k,), v) for k, v in evictions])
        yield _family("kvoffload_ghost_hits_total", ("list",), [((k,), v) for k, v in ghost_hits])

        medium = (s.medium,)
        yield _family("kvoffload_capacity_blocks", ("medium",), [(medium, s.capacity)])
        yield _family("kvoffload_used_blocks", ("medium",), [(medium, s.used)])
        yield _family("kvoffload_free_blocks", ("medium",), [(medium, s.free)])
        yield _family("kvoffload_pinned_blocks", ("medium",), [(medium, s.pinned)])
        yield _family("kvoffload_in_flight_blocks", ("medium",), [(medium, s.in_flight)])

        policy = s.policy
        yield _family("kvoffload_policy_info", ("policy",), [((policy,), 1)])
        yield _scalar("kvoffload_policy_version", version)
        yield _family(
            "kvoffload_policy_list_blocks",
            ("policy", "list"),
            [((policy, k), v) for k, v in resident.items()],
        )
        yield _family(
            "kvoffload_policy_ghost_entries",
            ("policy", "list"),
            [((policy, k), v) for k, v in ghosts.items()],
        )
        yield _family(
            "kvoffload_policy_parameter",
            ("policy", "name"),
            [((policy, k), v) for k, v in s.params.items()],
        )
        yield _family(
            "kvoffload_policy_counts_total",
            ("policy", "name"),
            [((policy, k), v) for k, v in s.policy_counters.items()],
        )
        w = s.window
        yield _scalar("kvoffload_hint_window_requests", w.requests)
        yield _scalar("kvoffload_hint_window_uses", w.uses)
        yield _scalar("kvoffload_hint_window_blocks", w.blocks)
        yield _scalar("kvoffload_hint_window_resident_blocks", w.resident)
        arc_lists = s.arc_lists  # arc and kvarc
        if arc_lists is not None:
            yield _family(
                "kvoffload_arc_list_blocks", ("list",), [((k,), v) for k, v in arc_lists.items()]
            )
            target = s.target_t1_size
            if target is not None:
                yield _scalar("kvoffload_arc_target_t1_blocks", target)

    def _static_metrics(self) -> Iterator[Metric]:
        yield _family(
            "kvoffload_build_info",
            ("version", "python", "block_table"),
            [((__version__, platform.python_version(), IMPLEMENTATION), 1)],
        )
        keys = sorted(self._config)
        yield _family("kvoffload_config_info", keys, [(tuple(self._config[k] for k in keys), 1)])

    def _event_metrics(self, ev: EventLogStats) -> Iterator[Metric]:
        yield _scalar("kvoffload_events_appended_total", ev.appended)
        yield _scalar("kvoffload_events_overwritten_total", ev.overwritten)
        yield _scalar("kvoffload_events_drained_total", ev.drained)
        yield _scalar("kvoffload_events_missed_total", ev.missed)
        yield _scalar("kvoffload_events_buffered", ev.buffered)
        yield _scalar("kvoffload_events_capacity", ev.capacity)
        yield _scalar("kvoffload_events_last_seq", ev.last_seq)

    def _runtime_metrics(self, snap: EngineSnapshot) -> Iterator[Metric]:
        r = snap.runtime
        yield _scalar("kvoffload_runtime_steps_total", r.steps)
        yield _scalar("kvoffload_runtime_requests_total", r.requests)
        tokens = (r.gpu_hit_tokens, r.cpu_hit_tokens, r.computed_tokens, r.truncated_tokens)
        yield _family(
            "kvoffload_runtime_prompt_tokens_total",
            ("outcome",),
            [((o,), n) for o, n in zip(PROMPT_TOKEN_OUTCOMES, tokens, strict=True)],
        )
        yield _scalar("kvoffload_runtime_verify_failures_total", r.verify_failures)
        yield _scalar("kvoffload_runtime_up", int(snap.state in _RUNNING_STATES))
        yield _scalar("kvoffload_runtime_paused", int(snap.state == "paused"))
        commands = snap.commands
        yield _family(
            "kvoffload_command_timestamp_seconds",
            ("command",),
            [((kind,), result.timestamp) for kind, result in sorted(commands.items())],
        )
        switch = commands.get("switch_policy")
        yield _family(
            "kvoffload_policy_switch_info",
            ("previous_policy", "policy"),
            [] if switch is None else [((switch.detail.get("from", ""), switch.policy), 1)],
        )


#: trace_id and span_id of the sampled step an observation was made in, or None
ExemplarSource: TypeAlias = Callable[[int | None], Mapping[str, str] | None]


class _Histogram:
    """A lock-free histogram: one writer thread, readers copy the counts.

    ``counts[i]`` holds observations in ``(bounds[i-1], bounds[i]]``; the last
    slot is the ``+Inf`` overflow. A reader derives ``_count`` from its copy
    of the buckets, so ``le="+Inf"`` always equals ``_count``. ``exemplars[i]``
    is the last observation of bucket ``i`` that came with exemplar labels
    (OpenMetrics shows it; the classic text format has no place for it).
    """

    __slots__ = ("bounds", "counts", "exemplars", "labels", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        go_float: Callable[[float], str] = floatToGoString
        self.labels = [go_float(b) for b in bounds] + ["+Inf"]
        self.counts = [0] * (len(bounds) + 1)
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, exemplar: Mapping[str, str] | None = None) -> None:
        i = bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        if exemplar is not None:
            self.exemplars[i] = Exemplar(dict(exemplar), value, time.time())

    def buckets(self) -> tuple[list[Bucket], float]:
        counts = list(self.counts)  # one C-level copy
        exemplars = list(self.exemplars)
        total = self.sum
        out: list[Bucket] = []
        acc = 0
        for label, n, exemplar in zip(self.labels, counts, exemplars, strict=True):
            acc += n
            out.append((label, acc) if exemplar is None else (label, acc, exemplar))
        return out, total


class PrometheusObserver(EngineObserver):
    """Counts transfer jobs and times steps as the engine reports them.

    Pass it to the engine (``Engine(config, observers=[obs])``) and register
    it on the same registry as the :class:`KVOffloadCollector`. Series for
    both directions and outcomes exist at 0 from the start.

    Hooks run on the engine thread and only bump integers; scrapes read them
    from another thread without a lock (a scrape may miss an observation
    made while it runs, never see a torn histogram).

    ``exemplars``: where an observation's exemplar comes from, called with
    the step (``None``: the step in progress); pass a
    :class:`~kvoffload.instrumentation.TracingObserver`'s ``exemplar`` and
    the step duration and transfer histograms carry, per bucket, the trace
    of the last sampled step that fell in it (OpenMetrics exposition only).
    """

    def __init__(
        self, *, registry: CollectorRegistry | None = None, exemplars: ExemplarSource | None = None
    ) -> None:
        self._exemplar = exemplars
        self._jobs = {(d, o): 0 for d in DIRECTIONS for o in TRANSFER_OUTCOMES}
        self._blocks = dict.fromkeys(DIRECTIONS, 0)
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._duration = {
            d: _Histogram(_spec("kvoffload_transfer_duration_seconds").buckets) for d in DIRECTIONS
        }
        self._size = {
            d: _Histogram(_spec("kvoffload_transfer_size_bytes").buckets) for d in DIRECTIONS
        }
        self._step = _Histogram(_spec("kvoffload_runtime_step_duration_seconds").buckets)
        if registry is not None:
            registry.register(self)

    # -- EngineObserver -------------------------------------------------------

    def transfer_finished(self, record: TransferRecord) -> None:
        d = record.direction
        if d not in self._blocks:  # a direction this version does not know
            return
        ok = record.ok
        key = (d, "ok" if ok else "failed")
        self._jobs[key] += 1
        # the step the job finished in, whose trace holds its span
        exemplar = self._exemplar(None) if self._exemplar is not None else None
        self._duration[d].observe(max(0, record.finished_ns - record.submitted_ns) / 1e9, exemplar)
        if ok:
            self._blocks[d] += record.blocks
            self._bytes[d] += record.nbytes
            self._size[d].observe(record.nbytes, exemplar)

    def step_finished(self, step: int, start_ns: int, end_ns: int, requests: int) -> None:
        exemplar = self._exemplar(step) if self._exemplar is not None else None
        self._step.observe(max(0, end_ns - start_ns) / 1e9, exemplar)

    # -- Collector ------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return _empty_families("observer")

    def collect(self) -> Iterator[Metric]:
        yield _family(
            "kvoffload_transfer_jobs_total",
            ("direction", "outcome"),
            [((d, o), n) for (d, o), n in list(self._jobs.items())],
        )
        yield _family(
            "kvoffload_transfer_gpu_blocks_total",
            ("direction",),
            [((d,), n) for d, n in list(self._blocks.items())],
        )
        yield _family(
            "kvoffload_transfer_bytes_total",
            ("direction",),
            [((d,), n) for d, n in list(self._bytes.items())],
        )
        for name, hists in (
            ("kvoffload_transfer_duration_seconds", self._duration),
            ("kvoffload_transfer_size_bytes", self._size),
        ):
            hfam = HistogramMetricFamily(name, _spec(name).help, labels=["direction"])
            for d, h in hists.items():
                buckets, total = h.buckets()
                hfam.add_metric([d], buckets, total)
            yield hfam
        name = "kvoffload_runtime_step_duration_seconds"
        hfam = HistogramMetricFamily(name, _spec(name).help, labels=[])
        buckets, total = self._step.buckets()
        hfam.add_metric([], buckets, total)
        yield hfam


class ApiMetrics:
    """The admin API's requests (``source="api"`` in the catalogue): counted
    by route name and outcome, timed by route name. :meth:`record` runs on
    the server's event loop, one thread; scrapes read without a lock, as
    :class:`PrometheusObserver`'s do. ``answered`` counts the requests
    recorded. (``app.request_metrics`` records them.)"""

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self._requests: dict[tuple[str, str], int] = {}
        self._duration: dict[str, _Histogram] = {}
        self._bounds = _spec("kvoffload_api_request_duration_seconds").buckets
        self.answered = 0
        if registry is not None:
            registry.register(self)

    def record(self, name: str, outcome: str, seconds: float) -> None:
        key = (name, outcome)
        self._requests[key] = self._requests.get(key, 0) + 1
        hist = self._duration.get(name)
        if hist is None:
            hist = self._duration[name] = _Histogram(self._bounds)
        hist.observe(seconds)
        self.answered += 1

    def describe(self) -> Iterable[Metric]:
        return _empty_families("api")

    def collect(self) -> Iterator[Metric]:
        requests = list(self._requests.items())
        yield _family("kvoffload_api_requests_total", ("name", "outcome"), requests)
        name = "kvoffload_api_request_duration_seconds"
        hfam = HistogramMetricFamily(name, _spec(name).help, labels=["name"])
        for route, h in list(self._duration.items()):
            buckets, total = h.buckets()
            hfam.add_metric([route], buckets, total)
        yield hfam


def _spec(name: str) -> MetricSpec:
    return METRICS_BY_NAME[name]
