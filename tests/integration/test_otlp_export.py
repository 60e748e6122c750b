"""``carpool serve --otlp-endpoint URL``: each request's timeline as OpenTelemetry spans,
received by an in-memory OTLP/HTTP collector started by the test and decoded with
opentelemetry-proto's own classes."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import DOUBLER_CONFIG, StartServer

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

NUM_REQUESTS = 12


class Collector:
    """An OTLP/HTTP traces receiver on 127.0.0.1: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.paths: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest.FromString(body)
                collector.paths.append(self.path)
                for resource_spans in request.resource_spans:
                    collector.resources.append(
                        {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    )
                    for scope_spans in resource_spans.scope_spans:
                        collector.spans.extend(scope_spans.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    running = Collector()
    yield running
    running.close()


def _attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out


def test_each_request_is_a_span_with_its_wait_and_compute(
    start_server: StartServer, collector: Collector
) -> None:
    served = start_server(DOUBLER_CONFIG, args=["--otlp-endpoint", collector.url])
    client = httpclient.InferenceServerClient(served.http_url)
    data = np.ones((1, 3), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    tensor.set_data_from_numpy(data)
    try:
        for _ in range(NUM_REQUESTS):
            client.infer("doubler", [tensor])
    finally:
        client.close()
    assert served.stop() == 0, served.output()  # the exporter flushes as the server stops

    assert set(collector.paths) == {"/v1/traces"}
    assert {"service.name": "carpool"}.items() <= collector.resources[0].items()
    roots = [s for s in collector.spans if s.name == "carpool.request"]
    assert len(roots) == NUM_REQUESTS
    by_parent: dict[bytes, list[Any]] = {}
    for span in collector.spans:
        by_parent.setdefault(span.parent_span_id, []).append(span)
    for root in roots:
        assert root.parent_span_id == b""
        attributes = _attributes(root)
        assert attributes["carpool.model"] == "doubler"
        assert attributes["carpool.outcome"] == "ok"
        assert attributes["carpool.num_items"] == 1
        events = {e.name: e.time_unix_nano for e in root.events}
        order = ["arrived", "batch closed", "compute started", "compute ended", "answered"]
        assert list(events) == order
        times = [events[name] for name in order]
        assert times == sorted(times)
        assert (root.start_time_unix_nano, root.end_time_unix_nano) == (times[0], times[-1])
        children = {c.name: c for c in by_parent[root.span_id]}
        assert children.keys() == {"carpool.wait", "carpool.compute"}
        assert all(c.trace_id == root.trace_id for c in children.values())
        wait, compute = children["carpool.wait"], children["carpool.compute"]
        assert (wait.start_time_unix_nano, wait.end_time_unix_nano) == (times[0], times[1])
        assert (compute.start_time_unix_nano, compute.end_time_unix_nano) == (times[2], times[3])
    assert len({r.trace_id for r in roots}) == NUM_REQUESTS


def test_without_the_flag_nothing_is_sent(start_server: StartServer, collector: Collector) -> None:
    served = start_server(DOUBLER_CONFIG)
    client = httpclient.InferenceServerClient(served.http_url)
    tensor = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
    try:
        client.infer("doubler", [tensor])
    finally:
        client.close()
    assert served.stop() == 0, served.output()
    assert collector.spans == []


def test_an_endpoint_that_is_no_url_exits_2(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--grpc-port", "0",
         "--otlp-endpoint", "collector:4318"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--otlp-endpoint" in run.stderr and "http(s) URL" in run.stderr


def test_a_generation_request_has_a_span_per_step(
    start_server: StartServer, collector: Collector
) -> None:
    import openai

    served = start_server(None, args=["--otlp-endpoint", collector.url])
    client = openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="unused")
    client.completions.create(model="tiny-random-llama", prompt="hello", max_tokens=5)
    client.close()
    assert served.stop() == 0, served.output()

    [root] = [s for s in collector.spans if s.name == "carpool.request"]
    attributes = _attributes(root)
    assert attributes["carpool.kind"] == "generation"
    num_generated = attributes["carpool.num_generated"]
    assert (attributes["carpool.outcome"], num_generated) == ("length", 5) or (
        # an end of sequence, possibly as the fifth token
        attributes["carpool.outcome"] == "stop" and 1 <= num_generated <= 5
    )
    assert [e.name for e in root.events] == ["arrived", "scheduled", "first token", "answered"]
    children = [s for s in collector.spans if s.parent_span_id == root.span_id]
    steps = sorted(
        (c for c in children if c.name == "carpool.step"), key=lambda c: c.start_time_unix_nano
    )
    assert [c.name for c in children if c.name != "carpool.step"] == ["carpool.queue"]
    assert len(steps) >= num_generated  # a prefill, then a decode per token
    assert [_attributes(c)["carpool.step"] for c in steps] == list(range(len(steps)))
    assert root.start_time_unix_nano <= steps[0].start_time_unix_nano
    assert steps[-1].end_time_unix_nano <= root.end_time_unix_nano
