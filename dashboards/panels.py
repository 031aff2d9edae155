"""PromQL and panel building blocks shared by the kvoffload dashboards.

Every query is scoped by the ``$job`` / ``$instance`` template variables, every
panel gets a unit and a description that ends with the metrics it reads (derived
from its queries, so it cannot drift from them).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import common as common_model
from grafana_foundation_sdk.models import dashboard as dashboard_model

#: The Prometheus data source chosen by the ``$datasource`` variable.
DATASOURCE = dashboard_model.DataSourceRef(type_val="prometheus", uid="${datasource}")

#: Label matchers that every query carries.
SCOPE = 'job="$job", instance=~"$instance"'

METRIC_NAME = re.compile(r"\bkvoffload_[a-z0-9_]+\b")


# --- PromQL -------------------------------------------------------------------------------


def series(metric: str, *, regex: dict[str, str] | None = None, **labels: str) -> str:
    """A selector for ``metric`` in the selected job/instances, plus exact label matches
    and ``regex`` ones."""
    matchers = [
        SCOPE,
        *(f'{name}="{value}"' for name, value in labels.items()),
        *(f'{name}=~"{value}"' for name, value in (regex or {}).items()),
    ]
    return f"{metric}{{{', '.join(matchers)}}}"


def total(metric: str, by: str = "", **labels: str) -> str:
    """A gauge summed over the selected instances, optionally kept apart ``by`` labels."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({series(metric, **labels)})"


def rate(metric: str, by: str = "", *, regex: dict[str, str] | None = None, **labels: str) -> str:
    """A counter's per-second rate summed over the selected instances (label
    matches as in :func:`series`)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series(metric, regex=regex, **labels)}[$__rate_interval]))"


def increase(metric: str, **labels: str) -> str:
    """How much a counter grew over the dashboard's time range."""
    return f"sum (increase({series(metric, **labels)}[$__range]))"


def ratio(numerator: str, denominator: str) -> str:
    """``numerator / denominator``; both are counters, so this is a ratio of
    rates. Where the denominator is 0 (no traffic) there is no value, not
    NaN: the panel says "No data" instead of plotting a gap labelled NaN."""
    return f"{numerator}\n/\n({denominator} > 0)"


def quantile(q: float, histogram: str, by: str = "") -> str:
    """The ``q`` quantile of a histogram over ``$__rate_interval``, per ``by``
    label; none (not NaN) where nothing was observed."""
    keys = ", ".join(key for key in ("le", by) if key)
    buckets = series(f"{histogram}_bucket")
    return f"histogram_quantile({q}, sum by ({keys}) (rate({buckets}[$__rate_interval]))) >= 0"


def mean(histogram: str, by: str = "") -> str:
    """A histogram's mean observation over ``$__rate_interval``."""
    return ratio(rate(f"{histogram}_sum", by), rate(f"{histogram}_count", by))


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL query and the legend its series get; ``exemplar``: Grafana
    also shows the exemplars of the histogram it reads (the trace of a
    sampled engine step in a bucket; Prometheus keeps them with
    ``--enable-feature=exemplar-storage``)."""

    expr: str
    legend: str = ""
    exemplar: bool = False


def metric_names(queries: Sequence[Query]) -> list[str]:
    """The kvoffload series the queries read, in order of first use."""
    names: dict[str, None] = {}
    for query in queries:
        names.update(dict.fromkeys(METRIC_NAME.findall(query.expr)))
    return list(names)


# --- panels -------------------------------------------------------------------------------


def _describe(what: str, queries: Sequence[Query]) -> str:
    metrics = ", ".join(f"`{name}`" for name in metric_names(queries))
    return f"{what}\n\nMetrics: {metrics}."


def _targets(
    queries: Sequence[Query], *, instant: bool
) -> list[cogbuilder.Builder[cogvariants.Dataquery]]:
    targets: list[cogbuilder.Builder[cogvariants.Dataquery]] = []
    for ref_id, query in zip(string.ascii_uppercase, queries, strict=False):
        target = prometheus.Dataquery().expr(query.expr).ref_id(ref_id).datasource(DATASOURCE)
        target = target.instant() if instant else target.range()
        if query.legend:
            target = target.legend_format(query.legend)
        if query.exemplar:
            target = target.exemplar(True)
        targets.append(target)
    return targets


def timeseries_panel(
    title: str,
    what: str,
    unit: str,
    queries: Sequence[Query],
    *,
    width: int = 12,
    height: int = 8,
    stacked: bool = False,
    min_value: float | None = None,
    max_value: float | None = None,
) -> timeseries.Panel:
    """A time series panel; ``what`` says in prose what it shows."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(_describe(what, queries))
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(_targets(queries, instant=False))
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(40 if stacked else 10)
        .show_points(common_model.VisibilityMode.NEVER)
        .legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(common_model.LegendDisplayMode.LIST)
            .placement(common_model.LegendPlacement.BOTTOM)
        )
        .tooltip(
            common.VizTooltipOptions()
            .mode(common_model.TooltipDisplayMode.MULTI)
            .sort(common_model.SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(common_model.StackingMode.NORMAL))
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    return panel


def stat_panel(
    title: str,
    what: str,
    unit: str,
    query: Query,
    *,
    width: int = 3,
    height: int = 4,
    show_name: bool = False,
    red_from: float | None = None,
    mappings: dict[str, tuple[str, str]] | None = None,
    decimals: float | None = None,
) -> stat.Panel:
    """A single-value panel over an instant query.

    ``show_name`` displays the series name (its legend) instead of the value, for info
    metrics; ``red_from`` turns the value red from that threshold on; ``mappings`` maps
    a value to a ``(text, color)``.
    """
    steps = [dashboard_model.Threshold(value=None, color="green")]
    if red_from is not None:
        steps.append(dashboard_model.Threshold(value=red_from, color="red"))
    text_mode = (
        common_model.BigValueTextMode.NAME if show_name else common_model.BigValueTextMode.VALUE
    )
    panel = (
        stat.Panel()
        .title(title)
        .description(_describe(what, [query]))
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(_targets([query], instant=True))
        .span(width)
        .height(height)
        .graph_mode(common_model.BigValueGraphMode.NONE)
        .color_mode(common_model.BigValueColorMode.VALUE)
        .text_mode(text_mode)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(
            dashboard.ThresholdsConfig().mode(dashboard_model.ThresholdsMode.ABSOLUTE).steps(steps)
        )
    )
    if mappings:
        options = {
            value: dashboard_model.ValueMappingResult(text=text, color=color, index=index)
            for index, (value, (text, color)) in enumerate(mappings.items())
        }
        panel = panel.mappings([dashboard_model.ValueMap(options=options)])
    if decimals is not None:
        panel = panel.decimals(decimals)
    return panel


# --- variables and annotations ------------------------------------------------------------


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(
    name: str, label: str, query: str, *, include_all: bool
) -> dashboard.QueryVariable:
    """A variable listing the values of a label (Grafana's ``label_values`` query)."""
    variable = (
        dashboard.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_model.VariableSort.ALPHABETICAL_ASC)
    )
    if include_all:
        variable = (
            variable.multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dashboard_model.VariableOption(selected=True, text="All", value="$__all"))
        )
    return variable


class _PrometheusAnnotationModel(dashboard_model.AnnotationQuery):
    """An annotation query with the Prometheus data source's own fields.

    The SDK's model stops at ``expr``; Grafana's Prometheus plugin also reads ``step``
    (the query resolution), ``titleFormat``/``textFormat`` (legend templates) and
    ``tagKeys`` (labels turned into tags) and ``useValueForTime`` (the value is the time).
    """

    def __init__(self, step: str, title_format: str, text_format: str, tag_keys: str) -> None:
        super().__init__()
        self.step = step
        self.title_format = title_format
        self.text_format = text_format
        self.tag_keys = tag_keys

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        payload.update(
            step=self.step,
            titleFormat=self.title_format,
            textFormat=self.text_format,
            tagKeys=self.tag_keys,
            # the series' value (milliseconds) is the event's time: a value that stays
            # the same over many steps is one event
            useValueForTime=True,
        )
        return payload


class PrometheusAnnotation(cogbuilder.Builder[dashboard_model.AnnotationQuery]):
    """Builds an annotation whose events are at the times a PromQL query's values name
    (Unix milliseconds, Grafana's *series value as timestamp*)."""

    def __init__(
        self,
        name: str,
        expr: str,
        *,
        step: str,
        title_format: str,
        text_format: str,
        tag_keys: str,
        icon_color: str,
    ) -> None:
        self._internal = _PrometheusAnnotationModel(step, title_format, text_format, tag_keys)
        self._internal.name = name
        self._internal.expr = expr
        self._internal.datasource = DATASOURCE
        self._internal.icon_color = icon_color
        self._internal.enable = True

    def build(self) -> dashboard_model.AnnotationQuery:
        return self._internal
