"""Minimal OTLP receivers on 127.0.0.1, over HTTP and over gRPC, that decode the
protobuf they get, as a collector would: what the tests read exported spans, log
records and metrics from."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

__all__ = ["MetricPoints", "Receiver", "attrs", "running_grpc_receiver", "running_receiver"]

#: one export's metrics: name -> [(attributes, value)] of its data points
MetricPoints = dict[str, list[tuple[dict[str, object], float]]]


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attrs(kvs: Any) -> dict[str, object]:
    """OTLP key-values as a dict."""
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass
class Receiver:
    """What :func:`running_receiver` received, decoded."""

    url: str
    #: what each request asked for: the URL path over HTTP, the method over gRPC
    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    logs: list[ExportLogsServiceRequest] = field(default_factory=list)
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    #: while cleared, requests wait (up to 10 s) before being answered
    open: threading.Event = field(default_factory=threading.Event)
    first_request: threading.Event = field(default_factory=threading.Event)

    def spans(self) -> list[Any]:
        return [
            span
            for req in list(self.traces)
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def log_records(self) -> list[Any]:
        return [
            rec
            for req in list(self.logs)
            for rl in req.resource_logs
            for sl in rl.scope_logs
            for rec in sl.log_records
        ]

    def metric_exports(self) -> list[tuple[int, MetricPoints]]:
        """Each metrics export, as (the latest time of its points in Unix ns, its points)
        in the order received."""
        out = []
        for req in list(self.metrics):
            points: MetricPoints = {}
            latest = 0
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        data = getattr(metric, metric.WhichOneof("data"))
                        for p in data.data_points:
                            value = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
                            points.setdefault(metric.name, []).append((attrs(p.attributes), value))
                            latest = max(latest, p.time_unix_nano)
            out.append((latest, points))
        return out


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    """A receiver serving on a free loopback port until the block ends."""
    state: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rec = state["r"]
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            rec.first_request.set()
            rec.open.wait(10)
            rec.paths.append(self.path)
            if self.path == "/v1/traces":
                rec.traces.append(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
            elif self.path == "/v1/logs":
                rec.logs.append(ExportLogsServiceRequest.FromString(body))
                reply = ExportLogsServiceResponse().SerializeToString()
            elif self.path == "/v1/metrics":
                rec.metrics.append(ExportMetricsServiceRequest.FromString(body))
                reply = ExportMetricsServiceResponse().SerializeToString()
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            return

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            # an exporter that gave up (its process ended, its timeout
            # passed) before a held answer: not the receiver's error
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Handler)
    host, port = server.server_address[:2]
    r = Receiver(url=f"http://{host!s}:{port}")
    r.open.set()
    state["r"] = r
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.open.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


#: the gRPC method of each signal's export (OTLP's collector services)
GRPC_METHODS = {
    "traces": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "logs": "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
    "metrics": "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
}


@contextmanager
def running_grpc_receiver() -> Iterator[Receiver]:
    """An OTLP/gRPC receiver (the collector's three export services, on a free
    loopback port, no TLS) until the block ends. ``paths`` holds the gRPC
    methods called (:data:`GRPC_METHODS`)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = server.add_insecure_port("127.0.0.1:0")
    r = Receiver(url=f"http://127.0.0.1:{port}")
    r.open.set()

    def received(signal: str, into: list[Any], request: Any) -> None:
        r.first_request.set()
        r.open.wait(10)
        r.paths.append(GRPC_METHODS[signal])
        into.append(request)

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:
            received("traces", r.traces, request)
            return ExportTraceServiceResponse()

    class Logs(logs_service_pb2_grpc.LogsServiceServicer):
        def Export(self, request: Any, context: Any) -> ExportLogsServiceResponse:
            received("logs", r.logs, request)
            return ExportLogsServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> ExportMetricsServiceResponse:
            received("metrics", r.metrics, request)
            return ExportMetricsServiceResponse()

    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    server.start()
    try:
        yield r
    finally:
        r.open.set()
        server.stop(grace=None).wait(5)
