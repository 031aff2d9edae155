"""The kvoffload overview dashboard: one screen from cache effectiveness down to events."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from grafana_foundation_sdk.builders import dashboard, stat, timeseries
from grafana_foundation_sdk.models import dashboard as dashboard_model

from dashboards.panels import (
    PrometheusAnnotation,
    Query,
    datasource_variable,
    increase,
    label_variable,
    mean,
    quantile,
    rate,
    ratio,
    series,
    stat_panel,
    timeseries_panel,
    total,
)

UID = "kvoffload-overview"

Panel = stat.Panel | timeseries.Panel


def _reused_tokens(window: Callable[..., str]) -> str:
    """Prompt tokens served without recompute (GPU prefix hits plus CPU-tier hits)."""
    return (
        f"{window('kvoffload_runtime_prompt_tokens_total', outcome='gpu_hit')}\n+\n"
        f"{window('kvoffload_runtime_prompt_tokens_total', outcome='cpu_hit')}"
    )


def _headline() -> list[Panel]:
    return [
        stat_panel(
            "Prompt tokens reused",
            "What is my hit ratio: prompt tokens whose KV was reused instead of recomputed"
            " (found in the GPU prefix cache or loaded back from the CPU tier) over all prompt"
            " tokens, over the time range.",
            "percentunit",
            Query(
                ratio(
                    f"(\n{_reused_tokens(increase)}\n)",
                    increase("kvoffload_runtime_prompt_tokens_total"),
                )
            ),
            decimals=1,
        ),
        stat_panel(
            "From the CPU tier",
            "The CPU tier's share of it: prompt tokens loaded back from the CPU tier instead of"
            " being recomputed, over all prompt tokens, over the time range.",
            "percentunit",
            Query(
                ratio(
                    increase("kvoffload_runtime_prompt_tokens_total", outcome="cpu_hit"),
                    increase("kvoffload_runtime_prompt_tokens_total"),
                )
            ),
            decimals=1,
        ),
        stat_panel(
            "Tier used",
            "Resident blocks as a share of the offload tier's capacity, now.",
            "percentunit",
            Query(ratio(total("kvoffload_used_blocks"), total("kvoffload_capacity_blocks"))),
            decimals=1,
        ),
        stat_panel(
            "Policy",
            "The eviction policy each instance runs now (switch it with PUT /v1/policy).",
            "none",
            Query(f"max by (policy) ({series('kvoffload_policy_info')})", "{{policy}}"),
            show_name=True,
        ),
        stat_panel(
            "Policy switches",
            "Live policy switches over the time range; each is marked on the graphs with the"
            " policies it switched from and to.",
            "none",
            Query(increase("kvoffload_policy_switches_total")),
            width=2,
            decimals=0,
        ),
        stat_panel(
            "Events missed",
            "Event-log records that readers asked for after their cursor and found gone"
            " (overwritten in the full ring, or drained), over the time range: a consumer is"
            " losing events. Records overwritten while nobody reads are no loss and not counted.",
            "count:events",
            Query(increase("kvoffload_events_missed_total")),
            width=2,
            red_from=1,
            decimals=0,
        ),
        stat_panel(
            "Failed transfers",
            "Transfer jobs (either direction) that failed over the time range; their stores were"
            " rolled back and their loads recomputed.",
            "count:jobs",
            Query(increase("kvoffload_transfer_jobs_total", outcome="failed")),
            width=2,
            red_from=1,
            decimals=0,
        ),
        stat_panel(
            "Engine",
            "Engine loop state per instance: down (0), running (1) or paused (2), computed as"
            " up * (1 + paused).",
            "none",
            Query(
                f"min by (instance) ({series('kvoffload_runtime_up')})\n"
                f"* (1 + max by (instance) ({series('kvoffload_runtime_paused')}))",
                "{{instance}}",
            ),
            mappings={"0": ("down", "red"), "1": ("running", "green"), "2": ("paused", "orange")},
        ),
        stat_panel(
            "Version",
            "The kvoffload version each instance runs.",
            "none",
            Query(f"max by (version) ({series('kvoffload_build_info')})", "{{version}}"),
            show_name=True,
        ),
    ]


def _effectiveness() -> list[Panel]:
    return [
        timeseries_panel(
            "Hit ratio",
            "Prompt tokens reused (GPU prefix cache plus CPU tier) and loaded from the CPU tier,"
            " as shares of all prompt tokens, and the share of looked-up offloaded blocks found"
            " in the tier; all from counter rates.",
            "percentunit",
            [
                Query(
                    ratio(
                        f"(\n{_reused_tokens(rate)}\n)",
                        rate("kvoffload_runtime_prompt_tokens_total"),
                    ),
                    "prompt tokens reused",
                ),
                Query(
                    ratio(
                        rate("kvoffload_runtime_prompt_tokens_total", outcome="cpu_hit"),
                        rate("kvoffload_runtime_prompt_tokens_total"),
                    ),
                    "prompt tokens from CPU",
                ),
                Query(
                    ratio(
                        rate("kvoffload_lookup_hit_blocks_total"),
                        rate("kvoffload_lookup_blocks_total"),
                    ),
                    "lookup blocks",
                ),
            ],
            min_value=0,
            max_value=1,
        ),
        timeseries_panel(
            "Prompt tokens by source",
            "Where the KV of each prompt token came from: already on the GPU, loaded from the"
            " CPU tier, or computed (a failed load's tokens included); truncated: past the"
            " prefix the simulated GPU cache prefills at once (half of it), not served.",
            "count:tokens/s",
            [Query(rate("kvoffload_runtime_prompt_tokens_total", "outcome"), "{{outcome}}")],
            stacked=True,
        ),
    ]


def _operations() -> list[Panel]:
    return [
        timeseries_panel(
            "Lookups",
            "Calls to lookup(): each asks how long a prefix of blocks is offloaded.",
            "count:lookups/s",
            [Query(rate("kvoffload_lookups_total"), "lookups")],
            width=8,
        ),
        timeseries_panel(
            "Block traffic",
            "Blocks looked up, found, loaded back to the GPU, prepared for storing and touched.",
            "count:blocks/s",
            [
                Query(rate("kvoffload_lookup_blocks_total"), "looked up"),
                Query(rate("kvoffload_lookup_hit_blocks_total"), "hit"),
                Query(rate("kvoffload_load_blocks_total"), "loaded"),
                Query(rate("kvoffload_store_prepared_blocks_total"), "store prepared"),
                Query(rate("kvoffload_touched_blocks_total"), "touched"),
            ],
            width=16,
        ),
        timeseries_panel(
            "Stores by outcome",
            "Blocks offered for storing: stored, skipped (already present), failed (transfer"
            " error) or rejected for lack of evictable room.",
            "count:blocks/s",
            [Query(rate("kvoffload_store_blocks_total", "outcome"), "{{outcome}}")],
            width=8,
            stacked=True,
        ),
        timeseries_panel(
            "Evictions by list",
            "Blocks evicted to make room, by the policy list they were evicted from.",
            "count:blocks/s",
            [Query(rate("kvoffload_evictions_total", "list"), "{{list}}")],
            width=8,
            stacked=True,
        ),
        timeseries_panel(
            "Failures and rejections",
            "prepare_store() calls rejected for lack of room, failed transfer jobs by direction,"
            " and loaded GPU blocks whose bytes did not verify, per second; each legend says"
            " what it counts.",
            "ops",
            [
                Query(rate("kvoffload_store_rejections_total"), "store calls rejected"),
                Query(
                    rate("kvoffload_transfer_jobs_total", "direction", outcome="failed"),
                    "{{direction}} jobs failed",
                ),
                Query(rate("kvoffload_runtime_verify_failures_total"), "GPU blocks unverified"),
            ],
            width=8,
        ),
    ]


def _occupancy() -> list[Panel]:
    return [
        timeseries_panel(
            "Blocks by state",
            "Offload-tier capacity and its offloaded blocks: used (resident), free, pinned"
            " (being loaded, ref_cnt > 0) and in flight (store not complete, ref_cnt = -1).",
            "count:blocks",
            [
                Query(total("kvoffload_capacity_blocks", "medium"), "{{medium}} capacity"),
                Query(total("kvoffload_used_blocks", "medium"), "{{medium}} used"),
                Query(total("kvoffload_free_blocks", "medium"), "{{medium}} free"),
                Query(total("kvoffload_pinned_blocks", "medium"), "{{medium}} pinned"),
                Query(total("kvoffload_in_flight_blocks", "medium"), "{{medium}} in flight"),
            ],
            width=8,
        ),
        timeseries_panel(
            "Resident blocks by list",
            "What is the cache doing: the resident offloaded blocks in each list of the active"
            " eviction policy (stacked, they add up to the used blocks).",
            "count:blocks",
            [Query(total("kvoffload_policy_list_blocks", "policy, list"), "{{policy}} {{list}}")],
            width=8,
            stacked=True,
        ),
        timeseries_panel(
            "Ghost lists",
            "Hashes of recently evicted offloaded blocks that the policy remembers (arc, kvarc,"
            " hkvarc: B1, B2); they hold no data and are not part of the tier's blocks.",
            "count:hashes",
            [
                Query(
                    total("kvoffload_policy_ghost_entries", "policy, list"),
                    "{{policy}} {{list}}",
                )
            ],
            width=8,
        ),
    ]


def _policy() -> list[Panel]:
    return [
        timeseries_panel(
            "Policy parameters",
            "The adaptive parameters of the active eviction policy, e.g. the ARC family's"
            " target size of T1 (in offloaded blocks; hkvarc's target_t1_in_line: the part of"
            " it for the blocks not held), against T1's actual size.",
            "count:blocks",
            [
                Query(
                    f"max by (policy, name) ({series('kvoffload_policy_parameter')})",
                    "{{policy}} {{name}}",
                ),
                Query(total("kvoffload_arc_list_blocks", list="t1"), "T1 size"),
            ],
        ),
        timeseries_panel(
            "Ghost hits",
            "Hits on a ghost list (arc: touches, kvarc: re-stores): a B1 hit grows the T1"
            " target, a B2 hit shrinks it.",
            "count:hits/s",
            [Query(rate("kvoffload_ghost_hits_total", "list"), "{{list}}")],
        ),
    ]


def _foresight() -> list[Panel]:
    return [
        timeseries_panel(
            "Hint window: waiting requests",
            "Requests that have arrived and wait to be served, hinted to the manager (the"
            " runtime hints its whole waiting queue whatever the policy; hkvarc uses it).",
            "count:requests",
            [Query(total("kvoffload_hint_window_requests"), "waiting requests")],
            width=8,
        ),
        timeseries_panel(
            "Hint window: blocks",
            "Offloaded blocks the waiting requests will use: all of them (offloaded or not),"
            " those resident in the offload tier now, and hkvarc's held lists h1 and h2 (the"
            " resident hinted blocks it keeps out of kvarc's order, by the class they came from).",
            "count:blocks",
            [
                Query(total("kvoffload_hint_window_blocks"), "hinted"),
                Query(total("kvoffload_hint_window_resident_blocks"), "hinted and resident"),
                Query(
                    "sum by (list) ("
                    + series("kvoffload_policy_list_blocks", regex={"list": "h1|h2"})
                    + ")",
                    "held {{list}}",
                ),
            ],
            width=8,
        ),
        timeseries_panel(
            "Foresight decisions",
            "What the policy did with the hints, per second (hkvarc): blocks deferred (taken"
            " out of kvarc's order because a waiting request uses them), victims redirected to"
            " held blocks (farthest next use first), stores declined, and the leading blocks hinted"
            " requests found resident in the CPU tier as they were served (GPU hits included).",
            "count:blocks/s",
            [Query(rate("kvoffload_policy_counts_total", "policy, name"), "{{policy}} {{name}}")],
            width=8,
        ),
    ]


def _transfers() -> list[Panel]:
    return [
        timeseries_panel(
            "Transfer throughput",
            "Bytes copied per second by direction (store = GPU to CPU, load = CPU to GPU).",
            "Bps",
            [Query(rate("kvoffload_transfer_bytes_total", "direction"), "{{direction}}")],
            width=8,
        ),
        timeseries_panel(
            "Transfer blocks",
            "GPU-sized blocks copied per second by direction.",
            "count:blocks/s",
            [Query(rate("kvoffload_transfer_gpu_blocks_total", "direction"), "{{direction}}")],
            width=8,
        ),
        timeseries_panel(
            "Transfer jobs",
            "Transfer jobs finished per second, by direction and outcome.",
            "count:jobs/s",
            [
                Query(
                    rate("kvoffload_transfer_jobs_total", "direction, outcome"),
                    "{{direction}} {{outcome}}",
                )
            ],
            width=8,
        ),
        timeseries_panel(
            "Transfer latency",
            "Time from submitting a transfer job to seeing it finished: median, p90 and p99 by"
            " direction; the p99 shows exemplars (the trace of a sampled step in which a job"
            " finished) where OpenTelemetry traces are exported.",
            "s",
            [
                Query(
                    quantile(q, "kvoffload_transfer_duration_seconds", "direction"),
                    f"{{{{direction}}}} p{round(q * 100)}",
                    exemplar=q == 0.99,  # the traces of slow jobs' steps
                )
                for q in (0.5, 0.9, 0.99)
            ],
        ),
        timeseries_panel(
            "Transfer size",
            "Bytes per transfer job: mean, median and p99 by direction.",
            "bytes",
            [
                Query(mean("kvoffload_transfer_size_bytes", "direction"), "{{direction}} mean"),
                Query(
                    quantile(0.5, "kvoffload_transfer_size_bytes", "direction"),
                    "{{direction}} p50",
                ),
                Query(
                    quantile(0.99, "kvoffload_transfer_size_bytes", "direction"),
                    "{{direction}} p99",
                ),
            ],
        ),
    ]


def _engine() -> list[Panel]:
    return [
        timeseries_panel(
            "Engine step time",
            "Wall time of one engine step (touch, lookup, load, compute, store, poll): mean,"
            " median, p90 and p99; the p99 shows exemplars (the trace of a sampled step) where"
            " OpenTelemetry traces are exported.",
            "s",
            [
                Query(mean("kvoffload_runtime_step_duration_seconds"), "mean"),
                *(
                    Query(
                        quantile(q, "kvoffload_runtime_step_duration_seconds"),
                        f"p{round(q * 100)}",
                        exemplar=q == 0.99,  # the traces of slow steps
                    )
                    for q in (0.5, 0.9, 0.99)
                ),
            ],
        ),
        timeseries_panel(
            "Engine throughput",
            "Engine steps run and requests served per second.",
            "count:/s",
            [
                Query(rate("kvoffload_runtime_steps_total"), "steps"),
                Query(rate("kvoffload_runtime_requests_total"), "requests"),
            ],
        ),
    ]


def _events() -> list[Panel]:
    return [
        timeseries_panel(
            "Event flow",
            "Offloading events appended to the event log, drained by consumers, overwritten in"
            " the full ring before any drain (normal without a drainer), and missed by readers"
            " that fell behind.",
            "count:events/s",
            [
                Query(rate("kvoffload_events_appended_total"), "appended"),
                Query(rate("kvoffload_events_drained_total"), "drained"),
                Query(rate("kvoffload_events_overwritten_total"), "overwritten"),
                Query(rate("kvoffload_events_missed_total"), "missed"),
            ],
        ),
        timeseries_panel(
            "Event backlog",
            "Events buffered and not yet drained (the consumers' lag), against the log's"
            " capacity; at capacity, new events push out the oldest.",
            "count:events",
            [
                Query(total("kvoffload_events_buffered"), "buffered"),
                Query(total("kvoffload_events_capacity"), "capacity"),
            ],
        ),
    ]


def _admin_api() -> list[Panel]:
    return [
        timeseries_panel(
            "Admin API requests",
            "Requests the admin API answered per second, by route and HTTP status (scrapes and"
            " dashboards polling included; 'unrouted' is a path or method no route serves).",
            "reqps",
            [Query(rate("kvoffload_api_requests_total", "name, outcome"), "{{name}} {{outcome}}")],
            width=8,
        ),
        timeseries_panel(
            "Admin API refusals",
            "Requests refused per second by HTTP status: 401 (no or a wrong token), 403 (a"
            " read token on a state-changing route, or no admin token configured), 404/405"
            " (unrouted), 413 (body too large), 408 (body too slow), 422 (bad input).",
            "reqps",
            [
                Query(
                    rate("kvoffload_api_requests_total", "outcome", regex={"outcome": "4.."}),
                    "{{outcome}}",
                )
            ],
            width=8,
        ),
        timeseries_panel(
            "Admin API latency",
            "Time from a request's arrival to its answer's status line (an event stream: the"
            " time to open it), p99 by route.",
            "s",
            [
                Query(
                    quantile(0.99, "kvoffload_api_request_duration_seconds", "name"),
                    "{{name}} p99",
                )
            ],
            width=8,
        ),
    ]


ROWS: Sequence[tuple[str, Callable[[], list[Panel]]]] = (
    ("Cache effectiveness", _effectiveness),
    ("Manager operations", _operations),
    ("Occupancy", _occupancy),
    ("Policy internals", _policy),
    ("Foresight", _foresight),
    ("Transfers", _transfers),
    ("Engine", _engine),
    ("Event pipeline", _events),
    ("Admin API", _admin_api),
)


def policy_switch_annotation() -> PrometheusAnnotation:
    """One marker per policy switch, at the moment it took effect, naming from and to.

    The series' value is the time of the last switch (read as the event's time), so
    each switch is one marker however many query steps see it."""
    switched = series("kvoffload_command_timestamp_seconds", command="switch_policy")
    return PrometheusAnnotation(
        "Policy switches",
        f"1000 * {switched}\n* on (job, instance) group_left (previous_policy, policy)\n"
        f"{series('kvoffload_policy_switch_info')}",
        step="15s",
        title_format="Policy switch",
        text_format="{{instance}}: {{previous_policy}} -> {{policy}}",
        tag_keys="instance,policy",
        icon_color="orange",
    )


def command_annotation() -> PrometheusAnnotation:
    """One marker per pause, resume and reset, at the moment it took effect."""
    commands = series(
        "kvoffload_command_timestamp_seconds", regex={"command": "pause|resume|reset"}
    )
    return PrometheusAnnotation(
        "Pause, resume, reset",
        f"1000 * {commands}",
        step="15s",
        title_format="{{command}}",
        text_format="{{instance}}: {{command}}",
        tag_keys="instance,command",
        icon_color="purple",
    )


def build() -> dashboard_model.Dashboard:
    board = (
        dashboard.Dashboard("kvoffload / Overview")
        .uid(UID)
        .description(
            "KV-cache offloading: what the hit ratio is, why it changed (policy switches, pauses,"
            " resets are marked), what the cache is doing (resident and ghost lists, the"
            " policy's parameters), GPU<->CPU transfers, the engine loop and the event pipeline."
        )
        .tags(["kvoffload"])
        .editable()
        .tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR)
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .with_variable(datasource_variable())
        .with_variable(
            label_variable(
                "job", "Job", "label_values(kvoffload_build_info, job)", include_all=False
            )
        )
        .with_variable(
            label_variable(
                "instance",
                "Instance",
                'label_values(kvoffload_build_info{job="$job"}, instance)',
                include_all=True,
            )
        )
        .annotation(policy_switch_annotation())
        .annotation(command_annotation())
    )
    ids = itertools.count(1)
    for panel in _headline():
        board = board.with_panel(panel.id(next(ids)))
    for title, panels in ROWS:
        board = board.with_row(dashboard.Row(title).id(next(ids)))
        for panel in panels():
            board = board.with_panel(panel.id(next(ids)))
    return board.build()
