"""Admin API latency under load, and what that load costs the engine.

Starts ``kvoffload serve`` (one process: the engine thread and the admin
server) as a subprocess on loopback (built-in workload, as fast as possible),
lets it warm up, then, per load, alternates windows of equal length (12
cycles of 2 s by default: about 4 minutes in all; a line per row goes to
stderr as it is done):

* **idle**: nothing but two ``GET /v1/cache`` reads, one at each end of the
  window, to read the engine's step counter;
* **load**: an open-loop generator in this process sends what real watchers
  send: a Prometheus scrape of ``/metrics`` once a second plus
  ``GET /v1/cache`` at 10 requests/s (ten open dashboards polling every
  second), at 50 requests/s, and, as a figure without a target, at 200
  requests/s (Poisson arrivals, seeded), over keep-alive connections,
  recording each request's latency;
* the **A/A** row is the control: its "load" windows are idle too, so its
  ratios are the measurement's own noise.

Each load window is compared with the mean of the idle windows just before
and after it, and the median of those ratios over the cycles is reported (a
burst of outside load spoils one cycle, not the result). Two ratios:

* **steps/s**: engine steps per second of the server's own clock (snapshot
  step and timestamp), the throughput the targets are about (>= 0.95 at 10
  requests/s, >= 0.9 at 50, p99 < 20 ms). On a shared machine it carries the
  machine's noise: a pure-Python loop's speed varies by 10-20% from one
  1.5 s window to the next on these 2-core machines, and the A/A row shows
  what that leaves in a median (a few percent either way).
* **engine CPU**: the share of the time the engine's thread ran (Linux
  /proc), loaded / idle. What it loses is what the server's requests take
  from it, the GIL held and the hand-overs; the host's own noise does not
  move it (A/A 1.000 +- 0.005). It does not see a slower engine that runs
  all the time, such as cache effects, so it bounds the throughput's ratio
  from above; the steps/s ratio averaged over runs is the check on that.

Latencies count from when each request was due, so client-side queueing
counts. On 2 cores, measure on an otherwise idle machine: the engine takes
one core, and the server's event loop and this load generator need the other.

Last, with the engine paused, the server's CPU time per ``GET /v1/cache``
and ``GET /livez`` (2000 in a row on one connection, least of 5): what a
request costs the GIL when nothing contends for it.

    .venv/bin/python bench/api.py [--window 2] [--cycles 12] [--quick] [--json] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
#: GET /v1/cache rates, each with one /metrics scrape a second; 0 is the
#: control row (no load at all: the measurement's own noise)
CACHE_RATES = (0, 10, 50, 200)
SCRAPES_PER_S = 1
#: the engine-throughput target per cache rate (None: a figure, no target)
TARGET_RATIO: dict[int, float | None] = {0: None, 10: 0.95, 50: 0.9, 200: None}
TARGET_P99_MS = 20.0
#: routes whose GIL time per request is measured with the engine paused
PER_REQUEST_ROUTES = ("/v1/cache", "/livez")
ADMIN_TOKEN = secrets.token_hex(16)


@dataclass(frozen=True)
class Phase:
    steps: int
    #: of the engine's clock (snapshot timestamps)
    seconds: float
    #: CPU seconds of the engine's thread over ``wall`` seconds of this process's clock
    engine_cpu: float
    wall: float

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def engine_share(self) -> float:
        """Share of the time the engine's thread ran: what it lost is time the
        server's requests held the GIL or a core from it. NaN off Linux."""
        return self.engine_cpu / self.wall if self.wall > 0 else float("nan")


@dataclass(frozen=True)
class Row:
    #: GET /v1/cache per second (plus SCRAPES_PER_S scrapes of /metrics)
    rate: int
    requests: int
    errors: int
    #: latency of GET /v1/cache
    p50_ms: float
    p99_ms: float
    max_ms: float
    #: latency of the /metrics scrapes (one a second: too few for a p99)
    scrape_p50_ms: float
    scrape_max_ms: float
    achieved_rate: float
    idle_steps_per_s: float
    loaded_steps_per_s: float
    idle_engine_share: float
    loaded_engine_share: float
    #: median over cycles of loaded steps/s / steps/s of the idle windows around it
    median_ratio: float
    #: the same for the engine thread's share of the time (Phase.engine_share)
    median_share_ratio: float

    @property
    def ratio(self) -> float:
        return self.median_ratio


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (all threads), or of its
    thread ``tid``, from Linux /proc; NaN elsewhere."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_thread(pid: int, seconds: float = 0.5) -> int | None:
    """The thread of ``pid`` that used the most CPU over ``seconds``: the
    engine's, once it runs (Python names no OS threads before 3.14). None
    off Linux."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    before = {t: cpu_seconds(pid, t) for t in tids}
    time.sleep(seconds)
    return max(tids, key=lambda t: cpu_seconds(pid, t) - before[t])


def serve_floor(port: int) -> None:
    """The floor to compare with: uvicorn serving a bare ASGI app (no
    framework, no rendering) in a process whose other thread is pure-Python
    busy work standing in for the engine. Its "steps" are rounds of that work,
    exposed like the service's step counter so the same measurement applies."""
    import threading

    import uvicorn

    sys.setswitchinterval(0.0005)  # as the service does
    rounds = [0]

    def busy() -> None:
        x = 0
        while True:
            for i in range(2000):
                x += i
            rounds[0] += 1

    threading.Thread(target=busy, daemon=True).start()

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        assert callable(receive) and callable(send)
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = "startup" if message["type"] == "lifespan.startup" else "shutdown"
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = json.dumps({"step": rounds[0], "timestamp": time.time()}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(port: int, extra: list[str], floor: bool = False) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVOFFLOAD_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["KVOFFLOAD_SPEED"] = "0"  # the engine replays at full speed during the benchmark
    env["KVOFFLOAD_ADMIN_TOKEN"] = ADMIN_TOKEN  # to pause it for the per-request figure
    if floor:
        cmd = [sys.executable, __file__, "--serve-floor", str(port)]
    else:
        cmd = [sys.executable, "-m", "kvoffload.cli", "serve", "--port", str(port), *extra]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("server not ready in time")


def engine_clock(client: httpx.Client) -> tuple[int, float]:
    view = client.get("/v1/cache").json()
    return int(view["step"]), float(view["timestamp"])


def keep_off_engine_cpu(engine: Engine) -> None:
    """Where the service pinned its engine thread to one CPU (``serve``'s
    ``--pin-threads``, the default), run this process, the stand-in for
    clients on other machines, on the other CPUs."""
    if engine.tid is None or not hasattr(os, "sched_setaffinity"):
        return
    engine_cpus = os.sched_getaffinity(engine.tid)
    others = os.sched_getaffinity(0) - engine_cpus
    if len(engine_cpus) == 1 and others:
        os.sched_setaffinity(0, others)


class Engine:
    """The server process and its engine thread, read around each window."""

    def __init__(self, pid: int, tid: int | None) -> None:
        self.pid = pid
        self.tid = tid

    def cpu(self) -> tuple[float, float]:
        """(the engine thread's CPU seconds, this process's clock)"""
        if self.tid is None:
            return float("nan"), time.perf_counter()
        return cpu_seconds(self.pid, self.tid), time.perf_counter()


def phase(client: httpx.Client, engine: Engine, window: Callable[[], None]) -> Phase:
    """The engine's progress while ``window()`` runs."""
    step0, t0 = engine_clock(client)
    cpu0, wall0 = engine.cpu()
    window()
    cpu1, wall1 = engine.cpu()
    step1, t1 = engine_clock(client)
    return Phase(step1 - step0, t1 - t0, cpu1 - cpu0, wall1 - wall0)


class _Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol
    for GETs with a Content-Length answer: a client this lean leaves the CPU
    to the server being measured."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def get(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length:
            await self.reader.readexactly(length)
        return status


def arrivals(rng: random.Random, rate: int, seconds: float) -> list[float]:
    """Poisson arrivals at ``rate`` a second over ``seconds``: what many
    dashboards polling on their own clocks add up to. (A grid of i/rate would
    put one read on every scrape's instant, a collision real pollers make only
    as often as chance does.)"""
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _load(
    port: int, rate: int, seconds: float, rng: random.Random
) -> tuple[list[float], list[float], int]:
    """Open loop: ``GET /v1/cache`` at :func:`arrivals`, and ``GET /metrics``
    every 1/SCRAPES_PER_S s from the window's start, whatever the answers do,
    each on an idle keep-alive connection (a new one when all are busy)."""
    idle: list[_Connection] = []
    opened: list[_Connection] = []
    latencies: list[float] = []
    scrapes: list[float] = []
    errors = 0

    async def one(request: bytes, scheduled: float) -> None:
        nonlocal errors
        conn = idle.pop() if idle else None
        try:
            if conn is None:
                conn = _Connection(*await asyncio.open_connection("127.0.0.1", port))
                opened.append(conn)
            status = await conn.get(request)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            return
        # latency from when the request was due: queueing in this client counts
        into = scrapes if b"/metrics" in request else latencies
        into.append(time.perf_counter() - scheduled)
        if status == 200:
            idle.append(conn)
        else:
            errors += 1

    def get(route: str) -> bytes:
        return f"GET {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()

    schedule = sorted(
        [(t, get("/v1/cache")) for t in arrivals(rng, rate, seconds)]
        + [(i / SCRAPES_PER_S, get("/metrics")) for i in range(int(SCRAPES_PER_S * seconds))]
    )
    start = time.perf_counter()
    tasks = []
    for offset, request in schedule:
        due = start + offset
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, due)))
    await asyncio.gather(*tasks)
    for conn in opened:
        conn.writer.close()
    return latencies, scrapes, errors


def cpu_per_request(
    proc: subprocess.Popen[bytes], port: int, route: str, n: int = 2000, repeats: int = 5
) -> float:
    """Microseconds of the server's CPU per ``GET route``, sent one after
    another on one keep-alive connection while the engine is paused: what a
    request costs the GIL when nothing contends for it. The least of
    ``repeats`` runs (other load only ever adds; the clock ticks every 10 ms,
    so a run of 2000 requests resolves about 5 us)."""
    request = f"GET {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()

    async def send_all() -> None:
        conn = _Connection(*await asyncio.open_connection("127.0.0.1", port))
        for _ in range(n):
            if await conn.get(request) != 200:
                raise SystemExit(f"GET {route} failed during the per-request measurement")
        conn.writer.close()

    best = float("inf")
    for _ in range(repeats):
        cpu0 = cpu_seconds(proc.pid)
        asyncio.run(send_all())
        best = min(best, (cpu_seconds(proc.pid) - cpu0) / n)
    return best * 1e6


def per_request_figures(
    proc: subprocess.Popen[bytes], port: int, client: httpx.Client
) -> dict[str, float]:
    """:func:`cpu_per_request` for each of PER_REQUEST_ROUTES; the engine is
    paused for it and resumed after."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    client.post("/v1/runtime:pause", headers=admin).raise_for_status()
    try:
        return {route: cpu_per_request(proc, port, route) for route in PER_REQUEST_ROUTES}
    finally:
        client.post("/v1/runtime:resume", headers=admin).raise_for_status()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def measure(
    engine: Engine, port: int, client: httpx.Client, rate: int, window: float, cycles: int
) -> Row:
    """``cycles`` x (idle window, load window), then a last idle window. Each
    load window is compared with the two idle windows around it; the row keeps
    the median of those ratios, so a burst of outside load spoils one cycle,
    not the result. Rate 0 is the control: its "load" windows are idle too,
    so its ratios are the measurement's own noise."""
    latencies: list[float] = []
    scrapes: list[float] = []
    errors = 0
    sent = 0
    wall = 0.0
    ratios: list[float] = []
    share_ratios: list[float] = []
    idle_rates: list[float] = []
    loaded_rates: list[float] = []
    idle_shares: list[float] = []
    loaded_shares: list[float] = []

    def idle() -> None:
        time.sleep(window)

    rng = random.Random(rate)  # the same arrivals in every run

    def load() -> None:
        lat, scr, err = asyncio.run(_load(port, rate, window, rng))
        latencies.extend(lat)
        scrapes.extend(scr)
        nonlocal errors, sent
        errors += err
        sent += len(lat) + len(scr) + err

    before = phase(client, engine, idle)
    for _ in range(cycles):
        loaded = phase(client, engine, load if rate else idle)
        wall += loaded.wall
        after = phase(client, engine, idle)
        idle_rate = (before.steps_per_second + after.steps_per_second) / 2
        idle_share = (before.engine_share + after.engine_share) / 2
        if idle_rate > 0:
            ratios.append(loaded.steps_per_second / idle_rate)
        if idle_share > 0 or math.isnan(idle_share):  # NaN off Linux: shown as such
            share_ratios.append(loaded.engine_share / idle_share)
        idle_rates.append(idle_rate)
        loaded_rates.append(loaded.steps_per_second)
        idle_shares.append(idle_share)
        loaded_shares.append(loaded.engine_share)
        before = after
    return Row(
        rate=rate,
        requests=sent,
        errors=errors,
        p50_ms=1000 * statistics.median(latencies) if latencies else float("nan"),
        p99_ms=1000 * percentile(latencies, 0.99),
        max_ms=1000 * max(latencies, default=float("nan")),
        scrape_p50_ms=1000 * statistics.median(scrapes) if scrapes else float("nan"),
        scrape_max_ms=1000 * max(scrapes, default=float("nan")),
        achieved_rate=sent / wall if wall > 0 else 0.0,
        idle_steps_per_s=statistics.median(idle_rates),
        loaded_steps_per_s=statistics.median(loaded_rates),
        idle_engine_share=statistics.median(idle_shares),
        loaded_engine_share=statistics.median(loaded_shares),
        median_ratio=statistics.median(ratios) if ratios else 0.0,
        median_share_ratio=statistics.median(share_ratios) if share_ratios else float("nan"),
    )


def run(
    rates: tuple[int, ...],
    window: float,
    cycles: int,
    warmup: float,
    server_args: list[str],
    floor: bool = False,
) -> tuple[list[Row], dict[str, float]]:
    """The rows per rate, then (not for the floor) :func:`per_request_figures`."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    own_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    proc = start_server(port, server_args, floor)
    rows: list[Row] = []
    per_request: dict[str, float] = {}
    try:
        wait_ready(base, proc)
        with httpx.Client(base_url=base, timeout=10.0) as client:
            time.sleep(warmup)
            engine = Engine(proc.pid, engine_thread(proc.pid))
            keep_off_engine_cpu(engine)
            for rate in rates:
                rows.append(measure(engine, port, client, rate, window, cycles))
                r = rows[-1]
                print(
                    f"  {r.rate or 'A/A'}: steps/s x{r.ratio:.3f}, engine CPU x{r.median_share_ratio:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
            if not floor:
                per_request = per_request_figures(proc, port, client)
    finally:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, own_cpus)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows, per_request


def ms(value: float, width: int) -> str:
    """A latency column; "-" where the row sent nothing (the A/A row)."""
    return f"{'-' if math.isnan(value) else f'{value:.2f}':>{width}}"


def as_json(row: Row) -> dict[str, object]:
    return {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(row).items()
    }


def print_table(rows: list[Row], server_args: list[str], title: bool = True) -> None:
    if title:
        print(f"kvoffload serve {' '.join(server_args)}  (built-in workload, full speed)")
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(f"load: GET /v1/cache at the rate below + GET /metrics {SCRAPES_PER_S}/s")
    header = (
        f"{'cache/s':>7} {'sent':>6} {'err':>4} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'scrape p50':>10} {'max':>6} {'steps/s idle':>13} {'loaded':>8} {'ratio':>6} {'target':>7} "
        f"{'engine CPU idle':>15} {'loaded':>7} {'ratio':>6}"
    )
    print(header)
    ok = {"steps/s ratio": True, "engine CPU ratio": True, "p99": True, "errors": True}
    for r in rows:
        target = TARGET_RATIO.get(r.rate)
        if target is not None:
            ok["steps/s ratio"] &= r.ratio >= target
            ok["engine CPU ratio"] &= r.median_share_ratio >= target
            ok["p99"] &= r.p99_ms < TARGET_P99_MS
            ok["errors"] &= r.errors == 0
        print(
            f"{r.rate if r.rate else 'A/A':>7} {r.requests:>6} {r.errors:>4} {ms(r.p50_ms, 8)} "
            f"{ms(r.p99_ms, 8)} {ms(r.max_ms, 8)} {ms(r.scrape_p50_ms, 10)} {ms(r.scrape_max_ms, 6)} "
            f"{r.idle_steps_per_s:>13.1f} "
            f"{r.loaded_steps_per_s:>8.1f} {r.ratio:>6.3f} "
            f"{'-' if target is None else f'{target:.2f}':>7} {r.idle_engine_share:>15.3f} "
            f"{r.loaded_engine_share:>7.3f} {r.median_share_ratio:>6.3f}"
        )
    if title:
        verdict = ", ".join(f"{k} {'ok' if v else 'BELOW TARGET'}" for k, v in ok.items())
        print(f"targets (ratios per row, /v1/cache p99 < {TARGET_P99_MS:g} ms): {verdict}")
        print(
            "steps/s ratios carry this machine's noise (the A/A row: no load at all); the "
            "engine CPU ratio is the share of time the engine's thread ran, loaded / idle"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--window",
        type=float,
        default=2.0,
        help="seconds per window (whole seconds: one scrape each)",
    )
    parser.add_argument("--cycles", type=int, default=12, help="idle/load cycles per row")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--quick", action="store_true", help="3 cycles of 1 s, 1 s warm-up")
    parser.add_argument(
        "--rates",
        default=",".join(map(str, CACHE_RATES)),
        help="comma-separated GET /v1/cache rates (each with /metrics once a second)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure a bare ASGI app next to pure-Python busy work: what any "
        "in-process HTTP server costs a busy thread on this machine",
    )
    parser.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument(
        "server_args",
        nargs="*",
        help="extra 'kvoffload serve' flags (after --), e.g. -- --num-cpu-blocks 4096",
    )
    args = parser.parse_args(argv)
    if args.serve_floor:
        serve_floor(args.serve_floor)
        return 0
    if args.quick:
        window, cycles, warmup = 1.0, 3, 1.0
    else:
        window, cycles, warmup = args.window, args.cycles, args.warmup
    rates = tuple(int(r) for r in args.rates.split(","))
    rows, per_request = run(rates, window, cycles, warmup, args.server_args)
    floor = run(rates, window, cycles, warmup, [], floor=True)[0] if args.floor else []
    if args.json:
        doc = {
            "service": [as_json(r) for r in rows],
            "cpu_us_per_request": per_request,
            "floor": [as_json(r) for r in floor],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print_table(rows, args.server_args)
    figures = ", ".join(f"{route} {us:.0f} us" for route, us in per_request.items())
    print(f"GIL time per request, engine paused (least of 5 x 2000, one connection): {figures}")
    if floor:
        print()
        print("floor: bare ASGI app + pure-Python busy thread (steps = rounds of busy work)")
        print_table(floor, [], title=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
