"""The ``kvoffload`` command line.

``kvoffload replay`` compares eviction policies on KV traces offline;
``kvoffload serve`` starts the admin service (the ``app`` package, installed
with the ``app`` extra). Usage errors print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from kvoffload._version import __version__
from kvoffload.errors import KVOffloadError
from kvoffload.runtime.trace import DEFAULT_TRACE_BLOCK_SIZE
from kvoffload.table import IMPLEMENTATION

if TYPE_CHECKING:
    from kvoffload.replay import BeladyResult, ReplayResult, ReplayTrace

__all__ = ["OneLineParser", "main"]

EXIT_USAGE = 2
#: the statuses a shell gives a command killed by SIGINT and SIGPIPE
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
DEFAULT_CAPACITIES = "1%,5%,10%,25%"


class OneLineParser(argparse.ArgumentParser):
    """argparse with errors on one line: what is wrong, then where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class UsageError(Exception):
    """A bad argument found after parsing (capacity, policy, trace file)."""


def _build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="kvoffload",
        description="KV-cache offloading: offline policy replay and the admin service.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvoffload {__version__} (block table: {IMPLEMENTATION})",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser
    )

    replay = commands.add_parser(
        "replay",
        help="replay KV traces against eviction policies and Belady's optimum",
        description=(
            "Replay Mooncake JSONL traces against an offloading manager, one offloaded "
            "block per trace block, for every (trace, policy, capacity) combination, "
            "and compare with Belady's optimal prefix hit ratio at each capacity."
        ),
    )
    replay.add_argument("traces", nargs="+", metavar="TRACE", help="Mooncake JSONL trace file")
    replay.add_argument(
        "--policy",
        default=None,
        metavar="P[,P...]",
        help="comma-separated eviction policies (default: all available)",
    )
    replay.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITIES,
        metavar="C[,C...]",
        help=(
            "comma-separated capacities: a block count ('1000') or a percentage of the "
            f"trace's unique blocks ('5%%'); default {DEFAULT_CAPACITIES.replace('%', '%%')}"
        ),
    )
    replay.add_argument(
        "--limit", type=_positive_int, default=None, metavar="N", help="replay the first N requests"
    )
    replay.add_argument(
        "--trace-block-size",
        type=_positive_int,
        default=DEFAULT_TRACE_BLOCK_SIZE,
        metavar="TOKENS",
        help=f"tokens per trace block id (default {DEFAULT_TRACE_BLOCK_SIZE}); the replay "
        "counts blocks, one per id, so this only labels the --json output",
    )
    replay.add_argument(
        "--lookahead",
        type=_lookahead,
        default=0,
        metavar="W",
        help=(
            "hint the next W requests to the manager while one is served, as an engine's "
            "waiting queue would (policies that use hints: hkvarc; the others ignore them); "
            "with W > 0 the table adds Belady with bypass ('bypass hit'), the bound for a "
            "policy that may decline stores; default 0"
        ),
    )
    replay.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead of a table"
    )
    replay.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=(
            "import MODULE first (repeatable): a module that registers your own policies "
            "with kvoffload.policies.register_policy, so --policy can name them"
        ),
    )
    replay.set_defaults(handler=_cmd_replay)

    # The service owns its flags (built from its settings); everything after
    # ``serve`` is handed to it unparsed, --help included.
    serve = commands.add_parser(
        "serve",
        add_help=False,
        help="start the admin service (needs the 'app' extra); flags are the service's",
        description=_SERVE_DESCRIPTION,
    )
    serve.set_defaults(handler=_cmd_serve)
    return parser


_SERVE_DESCRIPTION = (
    "Start the kvoffload service: the runtime plus the REST admin API. Its flags "
    "(and their --help) come from the service itself, installed with the 'app' extra."
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _lookahead(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a number of requests to hint ahead, 0 or more, got {text!r}"
        )
    return value


def _split(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UsageError(f"empty item in {what} list {text!r}")
    return items


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class _Row:
    """One (trace, policy, capacity) run and the bounds at its capacity (with
    bypass only for a replay with hints, where a policy may decline stores)."""

    result: ReplayResult
    bound: BeladyResult
    unique_blocks: int
    bypass_bound: BeladyResult | None = None

    @property
    def capacity_percent(self) -> float:
        return 100.0 * self.result.capacity / self.unique_blocks if self.unique_blocks else 0.0


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvoffload.errors import PolicyError
    from kvoffload.policies import available_policies, import_policy_modules
    from kvoffload.replay import ReplayTrace, belady, parse_capacity, replay
    from kvoffload.runtime.trace import load_mooncake_trace

    try:
        import_policy_modules(args.imports)
    except PolicyError as exc:
        raise UsageError(str(exc)) from exc
    valid = available_policies()
    policies = list(valid) if args.policy is None else _split(args.policy.lower(), "policy")
    unknown = [p for p in policies if p not in valid]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r}; valid policies: {', '.join(valid)}")
    capacity_specs = _split(args.capacity, "capacity")
    for path in args.traces:  # all of them, before loading any
        if Path(path).is_dir():
            raise UsageError(f"trace path is a directory, not a file: {path}")
        if not Path(path).is_file():
            raise UsageError(f"trace file not found: {path}")

    # Load and check everything before the long part starts.
    traces: list[tuple[ReplayTrace, int, list[int]]] = []
    for path in args.traces:
        workload = load_mooncake_trace(
            path, trace_block_size=args.trace_block_size, limit=args.limit
        )
        trace = ReplayTrace.from_requests(
            workload, name=workload.name, trace_block_size=args.trace_block_size
        )
        unique = trace.unique_blocks
        if not unique:
            raise UsageError(f"{path}: no blocks to replay (every request's hash_ids is empty)")
        capacities = [parse_capacity(spec, unique) for spec in capacity_specs]
        traces.append((trace, unique, capacities))

    # Belady counts as one more pass over the requests per capacity, and with
    # hints (policies may decline stores) Belady with bypass as another
    bounds = 2 if args.lookahead else 1
    total = sum(t.requests * len(caps) * (len(policies) + bounds) for t, _, caps in traces)
    rows: list[_Row] = []
    # the bar goes to stderr, so stdout stays clean for --json
    with _ProgressBar(total, enabled=sys.stderr.isatty()) as advance:
        for trace, unique, capacities in traces:
            for capacity in capacities:
                bound = belady(trace.block_hashes, capacity, progress=advance)
                bypass = (
                    belady(trace.block_hashes, capacity, bypass=True, progress=advance)
                    if args.lookahead
                    else None
                )
                for policy in policies:
                    result = replay(
                        trace,
                        policy=policy,
                        capacity=capacity,
                        progress=advance,
                        lookahead=args.lookahead,
                    )
                    rows.append(_Row(result, bound, unique, bypass))
    if args.json:
        _print_json(rows, traces, sys.stdout)
    else:
        _print_table(rows, sys.stdout)
    return 0


class _ProgressBar:
    """A tqdm bar on stderr counting replayed requests, or a no-op."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.bar: Any = None

    def __enter__(self) -> Callable[[int], object] | None:
        if not self.enabled:
            return None
        from tqdm import tqdm

        # A pseudo-terminal nobody sized (``script`` under CI, some IDE
        # consoles) reports 0 x 0, and tqdm then draws nothing at all.
        try:
            sized = all(os.get_terminal_size(sys.stderr.fileno()))
        except OSError:
            sized = False
        self.bar = tqdm(
            total=self.total,
            unit="req",
            file=sys.stderr,
            leave=False,
            **({} if sized else {"ncols": 80, "nrows": 24}),
        )
        return self.bar.update  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_json(
    rows: Sequence[_Row], traces: Sequence[tuple[ReplayTrace, int, list[int]]], out: TextIO
) -> None:
    document = {
        "kvoffload_version": __version__,
        "block_table": IMPLEMENTATION,
        "traces": [
            {
                "trace": trace.name,
                "trace_block_size": trace.trace_block_size,
                "requests": trace.requests,
                "block_accesses": trace.block_accesses,
                "unique_blocks": unique,
                "capacities": capacities,
            }
            for trace, unique, capacities in traces
        ],
        "runs": [_run_json(row) for row in rows],
    }
    json.dump(document, out, indent=2)
    out.write("\n")


def _run_json(row: _Row) -> dict[str, object]:
    r, b, bb = row.result, row.bound, row.bypass_bound
    return {
        "trace": r.trace,
        "policy": r.policy,
        "capacity_blocks": r.capacity,
        "capacity_percent": row.capacity_percent,
        "requests": r.requests,
        "block_accesses": r.block_accesses,
        "hit_blocks": r.hit_blocks,
        "prefix_hit_ratio": r.prefix_hit_ratio,
        "belady_hit_blocks": b.hit_blocks,
        "belady_hit_ratio": b.prefix_hit_ratio,
        "belady_bypass_hit_blocks": None if bb is None else bb.hit_blocks,
        "belady_bypass_hit_ratio": None if bb is None else bb.prefix_hit_ratio,
        "evictions": r.evictions,
        "rejected_stores": r.rejected_stores,
        "block_ops": r.block_ops,
        "block_ops_per_second": r.block_ops_per_second,
        "wall_seconds": r.wall_seconds,
        "lookahead": r.lookahead,
    }


_COLUMNS = (
    "trace",
    "policy",
    "capacity",
    "cap %",
    "prefix hit",
    "belady hit",
    "bypass hit",
    "block ops/s",
    "evictions",
    "lookahead",
)


def _print_table(rows: Sequence[_Row], out: TextIO) -> None:
    cells = [
        (
            row.result.trace,
            row.result.policy,
            str(row.result.capacity),
            f"{row.capacity_percent:.2f}",
            f"{row.result.prefix_hit_ratio:.4f}",
            f"{row.bound.prefix_hit_ratio:.4f}",
            "-" if row.bypass_bound is None else f"{row.bypass_bound.prefix_hit_ratio:.4f}",
            f"{row.result.block_ops_per_second:,.0f}",
            str(row.result.evictions),
            str(row.result.lookahead),
        )
        for row in rows
    ]
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]

    # text columns left-aligned, numbers right-aligned
    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i < 2 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    out.write(line(_COLUMNS) + "\n")
    for c in cells:
        out.write(line(c) + "\n")


# --------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    """Hand over to ``app.main.run(args.argv)``: the raw
    arguments after ``serve`` for the service to parse."""
    try:
        import app.main  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError as exc:
        if exc.name in ("app", "app.main"):
            problem = "the service is not installed (no 'app.main' module)"
        else:
            problem = f"the service needs the module {exc.name!r}, which is not installed"
        if "-h" in args.argv or "--help" in args.argv:
            # --help works everywhere, even without the service
            sys.stdout.write(
                f"usage: kvoffload serve [SERVICE FLAGS...]\n\n{_SERVE_DESCRIPTION}\n\n"
                f"Not available here: {problem}.\n"
            )
            return 0
        raise UsageError(f"{problem}; install kvoffload with the 'app' extra") from None
    result = app.main.run(list(args.argv))
    return result if isinstance(result, int) else 0


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvoffload`` command; returns (and, as a script, exits with)
    its status: 0 ok, 2 usage or input error."""
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        args.argv = extra
    elif extra:
        # blame the subcommand, whose --help lists what it takes
        OneLineParser(prog=f"{parser.prog} {args.command}").error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    handler: Callable[[argparse.Namespace], int] = args.handler
    prog = f"{parser.prog} {args.command}"
    try:
        return handler(args)
    except (UsageError, KVOffloadError) as exc:
        # one line: the messages name file/line/field where that applies
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        sys.stderr.write(f"\n{prog}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, as other tools do;
        # stdout to /dev/null so that flushing it at exit raises nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
