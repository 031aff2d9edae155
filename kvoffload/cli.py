"""The ``kvoffload`` command line.

``kvoffload replay`` compares eviction policies on KV traces offline;
``kvoffload serve`` starts the admin service (the ``app`` package, installed
with the ``app`` extra). Every error prints one line on stderr, never a
traceback; the exit status says which kind (see :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from kvoffload._checks import abridged, described
from kvoffload._version import __version__
from kvoffload.errors import KVOffloadError
from kvoffload.runtime.trace import DEFAULT_TRACE_BLOCK_SIZE
from kvoffload.table import IMPLEMENTATION

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

    from kvoffload.replay import BeladyResult, ReplayResult, ReplayTrace

__all__ = ["OneLineParser", "main"]

#: a policy raised during the replay; the other runs' results were printed
EXIT_POLICY_FAILED = 1
EXIT_USAGE = 2
#: standard output is closed or cannot be written (sysexits' EX_IOERR)
EXIT_OUTPUT = 74
#: the statuses a shell gives a command killed by SIGINT and SIGPIPE
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
DEFAULT_CAPACITIES = "1%,5%,10%,25%"
#: the largest value of an integer option (int64's)
MAX_INT_OPTION = 2**63 - 1


class OneLineParser(argparse.ArgumentParser):
    """argparse with errors on one line: what is wrong, then where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """argparse's, but what ``--help`` and ``--version`` fail to write on
        stdout is not dropped (``--help > /dev/full`` printed nothing and
        exited 0): one line and status 74, or 141 when the reader went away."""
        if file is None or file is not sys.stdout:
            super()._print_message(message, file)
            return
        try:
            _write_stdout(lambda out: out.write(message))
        except _OutputError as exc:
            self.exit(EXIT_OUTPUT, f"{self.prog}: error: {exc}\n")
        except BrokenPipeError:
            _discard_stdout()
            self.exit(EXIT_BROKEN_PIPE)


class UsageError(Exception):
    """A bad argument found after parsing (capacity, policy, trace file)."""


class _OutputError(Exception):
    """Standard output is closed or cannot be written (a full disk, ...)."""


class _RunFailures(Exception):
    """Policies that raised during the replay, one message each (the other
    runs' results were printed)."""

    def __init__(self, messages: Sequence[str]) -> None:
        super().__init__(*messages)
        self.messages = tuple(messages)


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
    replay.add_argument(
        "traces",
        nargs="+",
        metavar="TRACE",
        help="Mooncake JSONL trace file, gzip-compressed or not (a FIFO or /dev/stdin is read as a stream)",
    )
    # list options add up when repeated, as --import does
    replay.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="P[,P...]",
        help="comma-separated eviction policies, repeatable (default: all available)",
    )
    replay.add_argument(
        "--capacity",
        action="append",
        default=None,
        metavar="C[,C...]",
        help=(
            "comma-separated capacities, repeatable: a block count ('1000') or a percentage "
            "of the trace's unique blocks ('5%%'); default "
            f"{DEFAULT_CAPACITIES.replace('%', '%%')}"
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
        type=_lookaheads,
        action="append",
        default=None,
        metavar="W[,W...]",
        help=(
            "comma-separated windows, repeatable: hint the next W requests to the manager "
            "while one is served, as an engine's waiting queue would (policies that use "
            "hints: hkvarc; the others ignore them); every policy is replayed at each W; "
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


_DIGITS = re.compile(r"[0-9]+")


def _whole_number(text: str, minimum: int) -> int | None:
    """``text`` as an int from ``minimum`` to :data:`MAX_INT_OPTION` if it is
    plain ASCII digits (not ``+3``, ``1_000``, ``٣`` or `` 3``, which
    ``int()`` takes), else ``None``."""
    if not _DIGITS.fullmatch(text):
        return None
    digits = text.lstrip("0") or "0"
    # the length first: int() refuses more than 4300 digits
    if len(digits) > len(str(MAX_INT_OPTION)):
        return None
    value = int(digits)
    return value if minimum <= value <= MAX_INT_OPTION else None


def _positive_int(text: str) -> int:
    value = _whole_number(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer in plain digits, 1 to {MAX_INT_OPTION}, got "
            f"{abridged(text)}"
        )
    return value


def _lookaheads(text: str) -> list[int]:
    """A comma-separated list of windows, each in plain digits (as
    :func:`_whole_number` takes them), from 0 up."""
    windows = []
    for item in text.split(","):
        value = _whole_number(item, 0)
        if value is None:
            what = abridged(item) if item else "an empty item"
            raise argparse.ArgumentTypeError(
                f"expected a number of requests to hint ahead in plain digits, 0 to "
                f"{MAX_INT_OPTION}, got {what}" + (f" in {abridged(text)}" if "," in text else "")
            )
        windows.append(value)
    return windows


def _split(texts: Sequence[str], what: str) -> list[str]:
    """The items of comma-separated lists, repeated options' lists in order."""
    items = []
    for text in texts:
        listed = [item.strip() for item in text.split(",")]
        if not all(listed):
            raise UsageError(f"empty item in {what} list {text!r}")
        items += listed
    return items


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class _Row:
    """One (trace, capacity, window, policy) run and the bounds at its
    capacity (with bypass only for a replay with hints, where a policy may
    decline stores)."""

    result: ReplayResult
    bound: BeladyResult
    unique_blocks: int
    bypass_bound: BeladyResult | None = None

    @property
    def capacity_percent(self) -> float:
        return 100.0 * self.result.capacity / self.unique_blocks if self.unique_blocks else 0.0


#: a trace prepared for replay, its unique blocks and its capacities in blocks
_Trace = tuple["ReplayTrace", int, list[int]]


def _cmd_replay(args: argparse.Namespace) -> int:
    from kvoffload.errors import PolicyError
    from kvoffload.policies import import_policy_modules

    if sys.stdout is None:  # started with stdout closed (`>&-`): no result could be seen
        raise _OutputError(_STDOUT_CLOSED)
    try:
        import_policy_modules(args.imports)
    except PolicyError as exc:
        raise UsageError(str(exc)) from exc
    policies = _policies(args.policy)
    capacity_specs = _split(args.capacity or [DEFAULT_CAPACITIES], "capacity")
    for path in args.traces:  # all of them, before loading any
        _check_trace_path(path)
    # Load and check everything before the long part starts.
    traces = _load_traces(args.traces, capacity_specs, args.trace_block_size, args.limit)
    _build_policies(
        policies, sorted({c for _, _, caps in traces for c in caps}), args.trace_block_size
    )
    rows, failures = _replay_all(traces, policies, _windows(args.lookahead))
    if args.json:
        _write_stdout(lambda out: _print_json(rows, traces, out))
    else:
        _write_stdout(lambda out: _print_table(rows, out))
    if failures:
        raise _RunFailures(failures)
    return 0


def _load_traces(
    paths: Sequence[str], capacity_specs: Sequence[str], trace_block_size: int, limit: int | None
) -> list[_Trace]:
    """Each trace loaded, named by its label (:func:`_labels`), with its
    capacities; :class:`UsageError` for one with no block."""
    from kvoffload.replay import ReplayTrace, parse_capacity
    from kvoffload.runtime.trace import load_mooncake_trace

    traces = []
    for path, label in zip(paths, _labels(paths), strict=True):
        workload = load_mooncake_trace(path, trace_block_size=trace_block_size, limit=limit)
        trace = ReplayTrace.from_requests(workload, name=label, trace_block_size=trace_block_size)
        unique = trace.unique_blocks
        if not unique:
            raise UsageError(f"{path}: no blocks to replay (every request's hash_ids is empty)")
        traces.append((trace, unique, [parse_capacity(spec, unique) for spec in capacity_specs]))
    return traces


def _windows(lists: Sequence[list[int]] | None) -> list[int]:
    """The windows ``--lookahead`` names, in order (``[0]`` without it);
    :class:`UsageError` for one named twice."""
    windows = [w for listed in lists or [[0]] for w in listed]
    for n, w in enumerate(windows):
        if w in windows[:n]:
            raise UsageError(f"lookahead {w} is given twice; give each window once")
    return windows


def _replay_all(
    traces: Sequence[_Trace], policies: Sequence[str], windows: Sequence[int]
) -> tuple[list[_Row], list[str]]:
    """Every (trace, capacity, window, policy) run, in that order, and one
    message per policy that raised: it is not run again, the others go on."""
    from kvoffload.replay import ReplayError, belady, replay

    # Belady counts as one more pass over the requests per capacity, and with
    # hints (policies may decline stores) Belady with bypass as another
    bounds = 2 if any(windows) else 1
    runs = len(policies) * len(windows) + bounds
    total = sum(t.requests * len(caps) * runs for t, _, caps in traces)
    rows: list[_Row] = []
    failures: dict[str, str] = {}  # policy -> why it stopped
    # the bar goes to stderr, so stdout stays clean for --json
    with _ProgressBar(total, enabled=sys.stderr.isatty()) as advance:
        for trace, unique, capacities in traces:
            for capacity in capacities:
                bound = belady(trace.block_hashes, capacity, progress=advance)
                bypass = (
                    belady(trace.block_hashes, capacity, bypass=True, progress=advance)
                    if any(windows)
                    else None
                )
                for window in windows:
                    for policy in policies:
                        if policy in failures:
                            continue
                        try:
                            result = replay(
                                trace,
                                policy=policy,
                                capacity=capacity,
                                progress=advance,
                                lookahead=window,
                            )
                        except ReplayError as exc:  # the policy's own code raised
                            failures[policy] = str(exc)
                            continue
                        rows.append(_Row(result, bound, unique, bypass if window else None))
    return rows, list(failures.values())


def _policies(specs: Sequence[str] | None) -> list[str]:
    """The policies ``--policy`` names (every registered one without it), each
    once; :class:`UsageError` for one unknown, named twice, or whose
    registered target does not import as a policy class."""
    from kvoffload.errors import PolicyError
    from kvoffload.policies import available_policies, policy_class

    valid = available_policies()
    policies = list(valid) if specs is None else _split([spec.lower() for spec in specs], "policy")
    for n, policy in enumerate(policies):
        if policy not in valid:
            raise UsageError(f"unknown policy {policy!r}; valid policies: {', '.join(valid)}")
        if policy in policies[:n]:
            raise UsageError(f"policy {policy!r} is named twice; name each policy once")
        try:
            policy_class(policy)
        except PolicyError as exc:
            raise UsageError(str(exc)) from exc
    return policies


def _build_policies(policies: Sequence[str], capacities: Sequence[int], block_size: int) -> None:
    """Build each policy's manager at each capacity once, as the runs will,
    before anything is replayed: :class:`UsageError` naming the first policy
    whose constructor raises (each run builds its own again)."""
    from kvoffload.backends.cpu import CPUBackend
    from kvoffload.manager import PolicyOffloadingManager

    for policy in policies:
        for capacity in capacities:
            try:
                PolicyOffloadingManager(CPUBackend(block_size, capacity), policy=policy)
            except Exception as exc:  # any failure of a policy's code, one's own included
                raise UsageError(
                    f"policy {policy!r} cannot be built for {capacity} blocks: {described(exc)}"
                ) from exc


def _check_trace_path(path: str) -> None:
    """:class:`UsageError` unless ``path`` names something to read a trace from:
    a file, a FIFO or a device such as ``/dev/stdin`` (not a directory)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UsageError(f"trace file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read trace file {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"trace path is a directory, not a file: {path}")


def _labels(paths: Sequence[str]) -> list[str]:
    """Each trace's name in the output: the shortest tail of its path (in
    whole components) that no other path ends with, so ``a/t.jsonl`` and
    ``b/t.jsonl`` stay apart and a lone ``t.jsonl`` is just that.
    :class:`UsageError` for a path given twice."""
    parts = [Path(path).parts for path in paths]
    labels = []
    for i, mine in enumerate(parts):
        others = parts[:i] + parts[i + 1 :]
        if mine in others:
            raise UsageError(f"trace {paths[i]} is given twice; give each trace once")
        k = next(
            (k for k in range(1, len(mine)) if all(q[-k:] != mine[-k:] for q in others)),
            len(mine),
        )
        labels.append(str(Path(*mine[-k:])))
    return labels


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


_STDOUT_CLOSED = "standard output is closed; redirect it to a file (> FILE) or to /dev/null"


def _write_stdout(write: Callable[[TextIO], object]) -> None:
    """``write(sys.stdout)``, then flush it here: an error at exit would be
    a traceback. :class:`_OutputError` when stdout cannot be written (a
    :class:`BrokenPipeError` is let through: the reader went away)."""
    if sys.stdout is None:
        raise _OutputError(_STDOUT_CLOSED)
    try:
        write(sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputError(f"cannot write to standard output: {exc.strerror or exc}") from None


def _print_json(rows: Sequence[_Row], traces: Sequence[_Trace], out: TextIO) -> None:
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
    its status: 0 ok, 1 a policy raised during a replay (the other runs'
    results printed), 2 usage or input error, 74 standard output closed or
    not writable, 130 interrupted, 141 its reader went away."""
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
    return _report(f"{parser.prog} {args.command}", lambda: handler(args))


def _report(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s status, its errors turned into one line each on stderr (the
    messages name file/line/field where that applies) and a status."""
    try:
        return run()
    except _RunFailures as exc:
        for message in exc.messages:
            _error(prog, message)
        return EXIT_POLICY_FAILED
    except (UsageError, KVOffloadError) as exc:
        _error(prog, str(exc))
        return EXIT_USAGE
    except _OutputError as exc:
        _error(prog, str(exc))
        _discard_stdout()
        return EXIT_OUTPUT
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        sys.stderr.write(f"\n{prog}: interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, as other tools do
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def _error(prog: str, message: str) -> None:
    """``prog: error: message`` on one line of stderr (a message of several
    lines, a policy's own exception say, is joined)."""
    sys.stderr.write(f"{prog}: error: {' '.join(message.splitlines())}\n")


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that flushing what is left of it at exit
    raises nothing more."""
    # None (closed at start), or not a real file (a test's capture): nothing to point
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
