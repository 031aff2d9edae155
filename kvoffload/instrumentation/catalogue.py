"""The metric catalogue: every Prometheus metric kvoffload exposes, in one place.

The collector, the observer, the docs table and the tests all read
:data:`METRICS`; dashboards read metric names from it too. This module imports
nothing outside the standard library, so the catalogue is usable without
``prometheus_client``.

Conventions (DESIGN.md section 6): prefix ``kvoffload_``, base units, counters
end in ``_total``, no ratio gauges, and labels drawn only from
:data:`ALLOWED_LABELS` (plus the free labels of the info metrics).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ALLOWED_LABELS",
    "DIRECTIONS",
    "DURATION_BUCKETS",
    "METRICS",
    "METRICS_BY_NAME",
    "SIZE_BUCKETS",
    "TRANSFER_OUTCOMES",
    "MetricSpec",
    "render_markdown_table",
]

MetricType = Literal["counter", "gauge", "histogram"]
#: where a metric's value comes from
MetricSource = Literal["manager", "events", "runtime", "observer", "static", "api"]

#: the only label names a non-info metric may carry
ALLOWED_LABELS = frozenset({"policy", "list", "direction", "outcome", "medium", "name", "command"})

#: transfer directions: "store" = GPU->CPU, "load" = CPU->GPU
DIRECTIONS = ("store", "load")
TRANSFER_OUTCOMES = ("ok", "failed")
PROMPT_TOKEN_OUTCOMES = ("gpu_hit", "cpu_hit", "computed", "truncated")

#: seconds, 50 us .. 10 s (transfer jobs and engine steps)
DURATION_BUCKETS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: bytes, 4 KiB .. 4 GiB in powers of 4
SIZE_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4**k) for k in range(11))


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family as it appears in the exposition.

    ``name`` is the full family name as scraped (counters include ``_total``;
    histograms are the base name of their ``_bucket``/``_sum``/``_count``
    series).
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    source: MetricSource = "manager"
    #: an info metric: value always 1, labels carry the information
    info: bool = False
    #: labels besides ``labels`` come from a mapping the caller passes
    #: (``kvoffload_config_info``)
    open_labels: bool = False
    buckets: tuple[float, ...] = ()

    @property
    def base_name(self) -> str:
        """The name ``prometheus_client`` families take (without ``_total``)."""
        if self.type == "counter":
            return self.name.removesuffix("_total")
        return self.name


def _c(
    name: str, help: str, labels: tuple[str, ...] = (), source: MetricSource = "manager"
) -> MetricSpec:
    return MetricSpec(name, "counter", help, labels, source)


def _g(
    name: str, help: str, labels: tuple[str, ...] = (), source: MetricSource = "manager"
) -> MetricSpec:
    return MetricSpec(name, "gauge", help, labels, source)


METRICS: tuple[MetricSpec, ...] = (
    # -- manager counters ---------------------------------------------------
    _c("kvoffload_lookups_total", "Lookup calls made against the offloading manager."),
    _c("kvoffload_lookup_blocks_total", "Offloaded blocks named by lookup calls."),
    _c(
        "kvoffload_lookup_hit_blocks_total",
        "Offloaded blocks found ready by lookup calls (the hit prefix).",
    ),
    _c(
        "kvoffload_lookup_tokens_total",
        "Tokens named by lookup calls (lookup blocks times the offloaded block size).",
    ),
    _c(
        "kvoffload_lookup_hit_tokens_total",
        "Tokens found offloaded by lookup calls (hit blocks times the offloaded block size).",
    ),
    _c("kvoffload_load_blocks_total", "Offloaded blocks pinned for loading by prepare_load."),
    _c(
        "kvoffload_load_completed_blocks_total",
        "Offloaded blocks unpinned by complete_load (their loads finished, successful or not).",
    ),
    _c(
        "kvoffload_store_prepared_blocks_total",
        "Offloaded blocks allocated for storing by prepare_store.",
    ),
    _c(
        "kvoffload_store_blocks_total",
        "Offloaded blocks named in stores, by outcome: stored (completed), skipped_present "
        "(already offloaded), failed (store job failed), rejected_no_room.",
        ("outcome",),
    ),
    _c(
        "kvoffload_store_rejections_total",
        "prepare_store calls rejected because no room could be made.",
    ),
    _c(
        "kvoffload_evictions_total",
        "Offloaded blocks evicted, by the resident policy list the victim left.",
        ("list",),
    ),
    _c(
        "kvoffload_ghost_hits_total",
        "Hits on a ghost list (the remembered hash of an evicted offloaded block) by ghost "
        "list: touches for arc, re-stores for kvarc and hkvarc.",
        ("list",),
    ),
    _c("kvoffload_touched_blocks_total", "Offloaded blocks named by touch calls."),
    _c("kvoffload_policy_switches_total", "Live eviction-policy switches applied."),
    # -- manager gauges -----------------------------------------------------
    _g("kvoffload_capacity_blocks", "Offloaded blocks the offload tier can hold.", ("medium",)),
    _g(
        "kvoffload_used_blocks",
        "Offloaded blocks resident in the offload tier, including stores in flight.",
        ("medium",),
    ),
    _g("kvoffload_free_blocks", "Unallocated offloaded blocks of the offload tier.", ("medium",)),
    _g(
        "kvoffload_pinned_blocks",
        "Resident offloaded blocks pinned by loads in progress (ref_cnt > 0).",
        ("medium",),
    ),
    _g(
        "kvoffload_in_flight_blocks",
        "Offloaded blocks whose store is still in flight, not yet readable (ref_cnt = -1).",
        ("medium",),
    ),
    MetricSpec(
        "kvoffload_policy_info",
        "gauge",
        "The eviction policy in use (always 1; the policy label names it).",
        ("policy",),
        info=True,
    ),
    _g(
        "kvoffload_policy_version",
        "Policy version: 1 at start, incremented by every applied policy switch.",
    ),
    _g(
        "kvoffload_policy_list_blocks",
        "Offloaded blocks in each resident list of the current eviction policy.",
        ("policy", "list"),
    ),
    _g(
        "kvoffload_policy_ghost_entries",
        "Hashes of evicted offloaded blocks remembered in each ghost list of the current "
        "eviction policy (no data; arc, kvarc and hkvarc keep them).",
        ("policy", "list"),
    ),
    _g(
        "kvoffload_arc_list_blocks",
        "Sizes of the ARC family's lists: t1 and t2 in resident offloaded blocks, b1 and b2 in "
        "remembered hashes of evicted ones; present only while arc, kvarc or hkvarc is the policy.",
        ("list",),
    ),
    _g(
        "kvoffload_arc_target_t1_blocks",
        "The ARC family's adaptive target size of list t1, in offloaded blocks; present only "
        "while arc, kvarc or hkvarc is the policy.",
    ),
    _g(
        "kvoffload_policy_parameter",
        "Adaptive parameters of the current eviction policy, by parameter name (arc, kvarc: "
        "target_t1_size; hkvarc also target_t1_in_line, what T1 in line is held to).",
        ("policy", "name"),
    ),
    _c(
        "kvoffload_policy_counts_total",
        "The current eviction policy's own counts, by name, since start (summed over every "
        "time it was the policy); hkvarc: deferred, redirected and declined_blocks in offloaded "
        "blocks, hinted_hits the leading blocks a hinted request found resident in the CPU "
        "tier as it left the window (those the GPU cache also had included). lru, arc and "
        "kvarc have none.",
        ("policy", "name"),
    ),
    _g(
        "kvoffload_hint_window_requests",
        "Requests in the hint window: hinted as waiting to be served and not unhinted yet "
        "(the runtime's waiting queue; kept whatever the policy).",
    ),
    _g(
        "kvoffload_hint_window_uses",
        "Offloaded block hashes the requests in the hint window will use, repeats counted.",
    ),
    _g(
        "kvoffload_hint_window_blocks",
        "Distinct offloaded blocks the requests in the hint window will use (offloaded or not).",
    ),
    _g(
        "kvoffload_hint_window_resident_blocks",
        "Offloaded blocks the requests in the hint window will use that are resident now.",
    ),
    MetricSpec(
        "kvoffload_build_info",
        "gauge",
        "Build of kvoffload (always 1; labels give the library and Python versions "
        "and the block table in use, c or python).",
        ("version", "python", "block_table"),
        source="static",
        info=True,
    ),
    MetricSpec(
        "kvoffload_config_info",
        "gauge",
        "Engine configuration (always 1; one label per configuration field).",
        (),
        source="static",
        info=True,
        open_labels=True,
    ),
    # -- event log ----------------------------------------------------------
    _c("kvoffload_events_appended_total", "Records appended to the event log.", source="events"),
    _c(
        "kvoffload_events_overwritten_total",
        "Event-log records pushed out of the full ring by newer ones before any drain took "
        "them; normal without a drainer (readers that keep up still read them).",
        source="events",
    ),
    _c(
        "kvoffload_events_drained_total",
        "Event-log records removed by drain calls.",
        source="events",
    ),
    _c(
        "kvoffload_events_missed_total",
        "Event-log records readers asked for after a cursor > 0 that were already gone "
        "(overwritten or drained), summed over the answers (a read from 0, the oldest "
        "kept, misses nothing): a consumer is losing records.",
        source="events",
    ),
    _g(
        "kvoffload_events_buffered",
        "Records currently held in the event-log ring.",
        source="events",
    ),
    _g("kvoffload_events_capacity", "Records the event-log ring can hold.", source="events"),
    _g(
        "kvoffload_events_last_seq",
        "Sequence number of the newest event-log record (0 if none).",
        source="events",
    ),
    # -- runtime (EngineSnapshot only) --------------------------------------
    _c("kvoffload_runtime_steps_total", "Engine steps completed.", source="runtime"),
    _c(
        "kvoffload_runtime_requests_total",
        "Requests fully processed by the engine.",
        source="runtime",
    ),
    _c(
        "kvoffload_runtime_prompt_tokens_total",
        "Prompt tokens (in full GPU blocks) by where their KV came from: gpu_hit, cpu_hit "
        "(loaded from the offload tier) or computed (a failed load's included); truncated: "
        "past the prefix the simulated GPU cache prefills at once (half of it), not served.",
        ("outcome",),
        source="runtime",
    ),
    _c(
        "kvoffload_runtime_verify_failures_total",
        "Loaded GPU blocks whose bytes differed from what was stored (must stay 0).",
        source="runtime",
    ),
    _g(
        "kvoffload_runtime_up",
        "1 while the engine is running, paused, or has finished a non-looping replay (as "
        "/readyz), else 0: it stopped or failed.",
        source="runtime",
    ),
    _g("kvoffload_runtime_paused", "1 while the engine is paused, else 0.", source="runtime"),
    _g(
        "kvoffload_command_timestamp_seconds",
        "Unix time the last command of each kind took effect (switch_policy, pause, resume, "
        "reset); a kind's series appears with its first command.",
        ("command",),
        source="runtime",
    ),
    MetricSpec(
        "kvoffload_policy_switch_info",
        "gauge",
        "The last policy switch applied (always 1; labels name the policy switched from, "
        "previous_policy, and to, policy; absent until a switch).",
        ("previous_policy", "policy"),
        source="runtime",
        info=True,
    ),
    # -- observer-driven ------------------------------------------------------
    _c(
        "kvoffload_transfer_jobs_total",
        "Transfer jobs finished, by direction (store = GPU to CPU, load = CPU to GPU) and outcome.",
        ("direction", "outcome"),
        source="observer",
    ),
    _c(
        "kvoffload_transfer_gpu_blocks_total",
        "GPU blocks (gpu_block_size tokens each) copied by successful transfer jobs, by direction.",
        ("direction",),
        source="observer",
    ),
    _c(
        "kvoffload_transfer_bytes_total",
        "Bytes copied by successful transfer jobs, by direction.",
        ("direction",),
        source="observer",
    ),
    MetricSpec(
        "kvoffload_transfer_duration_seconds",
        "histogram",
        "Time from submission to completion of transfer jobs (successful or not), by direction.",
        ("direction",),
        source="observer",
        buckets=DURATION_BUCKETS,
    ),
    MetricSpec(
        "kvoffload_transfer_size_bytes",
        "histogram",
        "Bytes copied per successful transfer job, by direction.",
        ("direction",),
        source="observer",
        buckets=SIZE_BUCKETS,
    ),
    MetricSpec(
        "kvoffload_runtime_step_duration_seconds",
        "histogram",
        "Wall-clock duration of engine steps.",
        (),
        source="observer",
        buckets=DURATION_BUCKETS,
    ),
    # -- the admin API's own (app/, not the library) ------------------------
    _c(
        "kvoffload_api_requests_total",
        "Admin API requests answered, by route (name: the method and route path, as "
        "'PUT /v1/policy', or 'unrouted' for a path or method no route serves) and HTTP "
        "status code (outcome: '200', '401', ...; 'closed' when the client left before an "
        "answer).",
        ("name", "outcome"),
        source="api",
    ),
    MetricSpec(
        "kvoffload_api_request_duration_seconds",
        "histogram",
        "Time from an admin API request's arrival to its answer's status line (for an event "
        "stream, until it opens), by route (name, as in kvoffload_api_requests_total).",
        ("name",),
        source="api",
        buckets=DURATION_BUCKETS,
    ),
)

METRICS_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def _fmt_labels(spec: MetricSpec) -> str:
    parts = [f"`{label}`" for label in spec.labels]
    if spec.open_labels:
        parts.append("one per config field")
    return ", ".join(parts) if parts else "—"


def render_markdown_table(metrics: Iterable[MetricSpec] = METRICS) -> str:
    """The catalogue as a Markdown table (what ``docs/observability.md`` embeds)."""
    lines = [
        "| metric | type | labels | source | help |",
        "|---|---|---|---|---|",
    ]
    for m in metrics:
        kind = "info (gauge)" if m.info else m.type
        help_text = m.help.replace("|", "\\|")
        lines.append(f"| `{m.name}` | {kind} | {_fmt_labels(m)} | {m.source} | {help_text} |")
    return "\n".join(lines) + "\n"
