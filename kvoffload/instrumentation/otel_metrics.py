"""The metric catalogue over OTLP: a bridge from the Prometheus registry to
OpenTelemetry observable instruments (``opentelemetry-api`` only).

The service's metrics live in one ``prometheus_client`` registry (scraped at
``/metrics``). For backends that take OTLP instead, :class:`OTelMetricsBridge`
creates one observable instrument per catalogue entry on a ``MeterProvider``
the caller passes; at each export the instruments read the registry (once per
export, however many instruments ask), so both paths report the same
numbers from the same snapshots and nothing runs on the engine's hot path.

Counters become observable counters named without ``_total`` (OTLP-to-
Prometheus converters add it back), gauges observable gauges; names ending
in ``_seconds`` or ``_bytes`` carry the unit (``s``, ``By``). OTel has no
observable histogram, so a histogram is exported as its ``_count`` and
``_sum`` counters (rates and means survive; quantiles come from ``/metrics``),
which a converter that adds ``_total`` to counters names ``..._count_total``
and ``..._sum_total``: the dashboards' histogram panels read ``/metrics``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from prometheus_client import CollectorRegistry

from kvoffload._version import __version__
from kvoffload.instrumentation.catalogue import METRICS

__all__ = ["OTelMetricsBridge"]

#: name suffix -> UCUM unit, for backends that read units (the name already
#: carries it, so a converter that appends units adds nothing)
_UNITS = {"_seconds": "s", "_bytes": "By"}


def _unit(name: str) -> str:
    return next((unit for suffix, unit in _UNITS.items() if name.endswith(suffix)), "")


_Samples = dict[str, list[tuple[dict[str, str], float]]]


class OTelMetricsBridge:
    """Mirror ``registry``'s catalogue metrics as observable instruments of
    ``meter_provider`` (see the module docstring). Keep a reference for as long
    as the export should run; :meth:`samples` is the one read of the registry."""

    def __init__(
        self,
        meter_provider: MeterProvider,
        registry: CollectorRegistry,
    ) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._cached: _Samples | None = None
        #: samples handed out from ``_cached`` (a name asked again means a
        #: new collection has begun)
        self._served: set[str] = set()
        meter = meter_provider.get_meter("kvoffload", __version__)
        #: OTel instrument name -> exposition sample name it reports
        self.instruments: dict[str, str] = {}
        for spec in METRICS:
            if spec.type == "counter":
                self._counter(meter, spec.base_name, spec.name, spec.help, _unit(spec.base_name))
            elif spec.type == "gauge":
                self.instruments[spec.name] = spec.name
                meter.create_observable_gauge(
                    spec.name,
                    callbacks=[self._callback(spec.name)],
                    description=spec.help,
                    unit=_unit(spec.name),
                )
            else:
                # no unit: a converter would append it after "_count"/"_sum"
                for part in ("count", "sum"):
                    sample = f"{spec.name}_{part}"
                    self._counter(meter, sample, sample, f"{part} of {spec.help}", "")

    def _counter(self, meter: Meter, name: str, sample: str, help_text: str, unit: str) -> None:
        self.instruments[name] = sample
        meter.create_observable_counter(
            name, callbacks=[self._callback(sample)], description=help_text, unit=unit
        )

    def samples(self, sample: str | None = None) -> _Samples:
        """Every sample of the registry by name, read once per collection.

        An export asks each instrument's callback once; the first callback
        of a collection finds its own sample name already served from the
        last read and reads the registry again, the others reuse that read.
        So one export costs one read, and none reports numbers from before
        it began (the final export at shutdown included). ``sample=None``
        always reads afresh.
        """
        with self._lock:
            if self._cached is None or sample is None or sample in self._served:
                out: _Samples = defaultdict(list)
                for family in self._registry.collect():
                    for s in family.samples:
                        out[s.name].append((s.labels, s.value))
                self._cached = out
                self._served = set()
            if sample is not None:
                self._served.add(sample)
            return self._cached

    def _callback(self, sample: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            samples = self.samples(sample).get(sample, ())
            return [Observation(value, labels) for labels, value in samples]

        return observe
