"""Replay throughput with telemetry off vs on, printed as ratios (target >= 0.9).

"on" is everything a service runs: the PrometheusObserver and the scrape-time
collector on one registry, scraped every second from another thread, plus the
TracingObserver exporting spans and log records over OTLP/HTTP (through
app/telemetry.py, configured by OTEL_* variables) to a receiver in a separate
process, at the default sampling (parentbased_traceidratio 0.01).

    .venv/bin/python bench/overhead.py                   # Mooncake conversation trace
    .venv/bin/python bench/overhead.py --requests 500 --repeats 9 --always-on

Runs alternate between modes (ABBA order) and the headline is the median of
per-pair throughput ratios, so that a machine busy with something else skews
both sides alike. The CPU-time ratio (process CPU seconds, all threads) is
printed too: it is the steadier number on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for app.telemetry when run as a script

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from app.telemetry import setup_telemetry  # noqa: E402
from kvoffload.instrumentation import (  # noqa: E402
    KVOffloadCollector,
    PrometheusObserver,
    config_labels,
)
from kvoffload.runtime.config import EngineConfig  # noqa: E402
from kvoffload.runtime.engine import Engine  # noqa: E402
from kvoffload.runtime.observer import EngineObserver  # noqa: E402
from kvoffload.runtime.synthetic import SyntheticConfig, SyntheticWorkload  # noqa: E402
from kvoffload.runtime.trace import load_mooncake_trace  # noqa: E402
from kvoffload.runtime.workloads import Workload  # noqa: E402

DEFAULT_TRACE = ROOT / "data" / "traces" / "mooncake_conversation_trace.jsonl"

# An OTLP/HTTP sink: answers 200 to every POST and throws the body away.
RECEIVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass

s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


@dataclass
class Run:
    requests: int
    seconds: float
    #: CPU seconds of the whole process (engine, scraper and export threads)
    cpu_seconds: float
    scrapes: int = 0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace != "synthetic":
        return load_mooncake_trace(args.trace, limit=args.requests)
    return SyntheticWorkload(SyntheticConfig(num_requests=args.requests, trace_block_size=512))


def _config(args: argparse.Namespace) -> EngineConfig:
    # A deliberately small model (1 layer, 1 KV head of 8): steps of a few
    # milliseconds are the worst case for the relative cost of telemetry,
    # whose work per step does not depend on the size of the KV tensors.
    return EngineConfig(
        policy=args.policy,
        num_cpu_blocks=args.cpu_blocks,
        num_gpu_blocks=args.gpu_blocks,
        gpu_block_size=32,
        offloaded_block_size=512,
        num_layers=1,
        num_kv_heads=1,
        head_size=8,
        device=args.device,
        max_requests_per_step=4,
    )


def run_off(args: argparse.Namespace, workload: Workload) -> Run:
    engine = Engine(_config(args), workload)
    t0, c0 = time.perf_counter(), time.process_time()
    snap = engine.run()
    return Run(snap.runtime.requests, time.perf_counter() - t0, time.process_time() - c0)


def run_on(args: argparse.Namespace, workload: Workload, endpoint: str, sampler: str | None) -> Run:
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    if sampler is None:
        os.environ.pop("OTEL_TRACES_SAMPLER", None)
    else:
        os.environ["OTEL_TRACES_SAMPLER"] = sampler
    telemetry = setup_telemetry()
    assert telemetry.tracer_provider is not None and telemetry.logger_provider is not None
    registry = CollectorRegistry()
    tracing = telemetry.tracing_observer()
    observers: list[EngineObserver] = [PrometheusObserver(registry=registry), tracing]
    cfg = _config(args)
    engine = Engine(cfg, workload, observers)
    tracing.watch_event_log(engine.event_log)
    KVOffloadCollector(
        engine.snapshot,
        registry=registry,
        config_info=config_labels(cfg),
        event_log=engine.event_log,
    )

    stop = threading.Event()
    scrapes = [0]

    def scrape() -> None:
        while not stop.wait(args.scrape_interval):
            generate_latest(registry)
            scrapes[0] += 1

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    t0, c0 = time.perf_counter(), time.process_time()
    snap = engine.run()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    stop.set()
    scraper.join()
    generate_latest(registry)  # one last scrape, as Prometheus would
    telemetry.shutdown()
    return Run(snap.runtime.requests, seconds, cpu, scrapes[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL or 'synthetic'")
    p.add_argument("--requests", type=int, default=1000, help="requests per run")
    p.add_argument("--repeats", type=int, default=8, help="runs per mode")
    p.add_argument("--policy", default="arc")
    p.add_argument("--cpu-blocks", type=int, default=2048)
    p.add_argument("--gpu-blocks", type=int, default=1024)
    p.add_argument("--device", default="auto")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds")
    p.add_argument("--always-on", action="store_true", help="also measure with every step traced")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (0 = torch's default); 1 keeps idle threads from "
        "spinning, which makes runs on a shared machine far less noisy",
    )
    args = p.parse_args()
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[key]

    workload = _workload(args)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        endpoint = f"http://127.0.0.1:{receiver.stdout.readline().strip()}"
        modes: dict[str, Callable[[], Run]] = {
            "off": lambda: run_off(args, workload),
            "on (default sampling 0.01)": lambda: run_on(args, workload, endpoint, None),
        }
        if args.always_on:
            modes["on (always_on sampling)"] = lambda: run_on(args, workload, endpoint, "always_on")
        run_off(args, workload)  # warm-up: imports, allocator, first-touch
        results: dict[str, list[Run]] = {m: [] for m in modes}
        for i in range(args.repeats):
            # ABBA order: a load that rises or falls over a pair hits both modes alike
            order = list(modes.items()) if i % 2 == 0 else list(reversed(modes.items()))
            for mode, fn in order:
                results[mode].append(fn())
    finally:
        receiver.terminate()
        receiver.wait(5)
        if receiver.stdout is not None:
            receiver.stdout.close()

    print(f"workload: {workload.describe()}")
    cfg = _config(args)
    print(
        f"engine: policy={cfg.policy} cpu_blocks={cfg.num_cpu_blocks} "
        f"gpu_blocks={cfg.num_gpu_blocks} device={args.device}; {args.repeats} runs per mode"
    )
    off = results["off"]
    print(
        f"{'mode':<28} {'req/s median':>13} {'req/s best':>11} {'paired ratio':>13} "
        f"{'best ratio':>11} {'cpu ratio':>10} {'scrapes/run':>12}"
    )
    ratios: dict[str, float] = {}
    for mode, runs in results.items():
        # Runs alternate, so run i of every mode saw about the same machine:
        # the median of per-pair ratios cancels load that came and went.
        paired = statistics.median(r.rate / o.rate for r, o in zip(runs, off, strict=True))
        best = max(r.rate for r in runs) / max(o.rate for o in off)
        cpu = statistics.median(o.cpu_seconds for o in off) / statistics.median(
            r.cpu_seconds for r in runs
        )
        ratios[mode] = paired
        print(
            f"{mode:<28} {statistics.median(r.rate for r in runs):>13.1f} "
            f"{max(r.rate for r in runs):>11.1f} {paired:>13.3f} {best:>11.3f} {cpu:>10.3f} "
            f"{statistics.median(r.scrapes for r in runs):>12.0f}"
        )
    ratio = ratios["on (default sampling 0.01)"]
    print(f"overhead ratio (on/off throughput, default sampling, paired median): {ratio:.3f}")
    print("target >= 0.9")


if __name__ == "__main__":
    main()
