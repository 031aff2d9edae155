"""``/livez`` while many clients read large pages of events.

A page of 10,000 events is a few MB of JSON and a tenth of a second or more
of Python to build. Built on the event loop, every other request waits for
it: an audit saw ``/livez`` take 22.7 s behind 60 such readers, long enough
for a liveness probe to restart the pod. The service builds large answers in
worker threads, two at a time (``app/state.py``, ``ServiceState.render``),
so the loop answers between their GIL slices.

Starts ``kvoffload serve`` on loopback with an event log of 20,000 records,
lets the built-in workload fill it, pauses the engine (the pages are then
the same every time), and alternates windows: **idle** (``/livez`` probed
every 50 ms, nothing else) and **readers** (the same probes while
``--readers`` threads each loop ``GET /v1/events?limit=10000``; ``--events``
sets the log's size, a page being half of it). Prints the
probes' median, p99 and max latency in each, and the readers' pages per
second; ratios are loaded / idle of the same run (the machine is shared).

    .venv/bin/python bench/event_readers.py [--readers 60] [--cycles 3] [--window 5]
        [--events 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-admin-token"


def serve(port: int, events: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env.update({"KVOFFLOAD_ADMIN_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)})
    argv = [sys.executable, "-m", "kvoffload.cli", "serve", "--port", str(port), "--speed", "0",
            "--event-log-capacity", str(events), "--device", "cpu"]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def probe(base: str, seconds: float) -> list[float]:
    """``/livez`` latencies (s), one probe every 50 ms for ``seconds`` (a probe
    that times out after 60 s counts as 60 s)."""
    out: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            with contextlib.suppress(httpx.TimeoutException):  # counted at the timeout
                client.get("/livez")
            out.append(time.perf_counter() - t0)
            time.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))
    return out


def summary(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99, ordered[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=60, help="concurrent page readers")
    parser.add_argument("--cycles", type=int, default=3, help="idle/readers window pairs")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per window")
    parser.add_argument(
        "--events", type=int, default=20000, help="event log size; a page is half of it"
    )
    args = parser.parse_args()
    port = 18000 + os.getpid() % 1000
    base = f"http://127.0.0.1:{port}"
    page = args.events // 2
    proc = serve(port, args.events)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if (
                    httpx.get(f"{base}/v1/cache", timeout=2).json()["events"]["buffered"]
                    >= args.events
                ):
                    break
            except (httpx.TransportError, KeyError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit("the service did not fill its event log")
            time.sleep(0.5)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(f"{base}/v1/runtime:pause", headers=headers, timeout=30).raise_for_status()
        size = len(httpx.get(f"{base}/v1/events?limit={page}", timeout=60).content)
        print(f"a page: {page} events, {size / 1e6:.1f} MB; {args.readers} readers")
        idle: list[float] = []
        loaded: list[float] = []
        pages = 0
        errors: list[int] = []
        reading = 0.0  # seconds the readers ran
        for _ in range(args.cycles):
            idle += probe(base, args.window)
            stop = threading.Event()
            counts = [0] * args.readers

            def read(i: int, stop: threading.Event = stop, counts: list[int] = counts) -> None:
                with httpx.Client(base_url=base, timeout=120) as client:
                    while not stop.is_set():
                        try:
                            client.get(f"/v1/events?limit={page}")
                            counts[i] += 1
                        except httpx.HTTPError:
                            errors.append(i)

            threads = [threading.Thread(target=read, args=(i,)) for i in range(args.readers)]
            started = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(1.0)  # every reader has a request in
            loaded += probe(base, args.window)
            stop.set()
            for t in threads:
                t.join()
            pages += sum(counts)
            reading += time.monotonic() - started
        (i50, i99, imax), (l50, l99, lmax) = summary(idle), summary(loaded)
        print(f"{'':>10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
        print(f"{'idle':>10}{i50 * 1e3:>10.1f}{i99 * 1e3:>10.1f}{imax * 1e3:>10.1f}")
        print(f"{'readers':>10}{l50 * 1e3:>10.1f}{l99 * 1e3:>10.1f}{lmax * 1e3:>10.1f}")
        print(f"{'ratio':>10}{l50 / i50:>9.1f}x{l99 / i99:>9.1f}x{lmax / imax:>9.1f}x")
        rate = pages / reading
        print(f"pages read: {pages} ({rate:.1f}/s), reader errors: {len(errors)}")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
