"""The numbers `carpool serve` reports, against what its clients and its model saw.

A model that sleeps ``SLEEP_S`` per call and logs every call it gets (values, start, end,
whether it raised) is served with three priority classes. A bounded mix drives it over
HTTP (the fast path, and uvicorn's ASGI path through a ``?x=1`` query) and gRPC: good
requests at every priority, requests whose ``timeout`` expires in the queue, requests a
full queue refuses, malformed ones, ones the model raises on, clients that hang up while
queued. The test keeps its own ledger of every request and its outcome; afterwards
``/v2/models/{m}/stats`` and ``/metrics`` (read with prometheus_client's parser) must agree
with the ledger and the model's log exactly in every count, and with bounds in every
time (a sum of latencies is at least the model's sleep per request and at most what the
clients measured: no wall-clock thresholds). ``/metrics`` is scraped throughout the load:
no scrape fails, and no counter ever goes down.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process, wait_until

LIMIT_S = 20.0  # only against hangs
SLEEP_S = 0.005  # the model's cost per call
SLOW, SLOW_S = 999, 3.0  # a call with this value computes this much longer
MAX_BATCH_SIZE = 8
MAX_QUEUE_SIZE = 6  # < MAX_BATCH_SIZE: while the model is held, no full batch can form
CLASSES = ("interactive", "normal", "background")  # Triton priorities 1, 2, 3
DEFAULT_CLASS = "normal"
INTERACTIVE_SLO_S = 30.0  # every answer meets it
NORMAL_SLO_S = 1e-6  # no answer meets it

MODELS = f'''\
"""The model of test_reported_numbers: Y = 2 X, at a known cost, logging every call."""

import json
import os
import time


def metered(inputs):
    """Logs a call's values to $METER_STARTED, waits while $METER_GATE exists (at most
    30 s), sleeps {SLEEP_S} s ({SLOW_S} s more with a {SLOW}), logs the call to
    $METER_CALLS; raises on a negative value."""
    x = inputs["X"]
    values = [int(v) for v in x.ravel()]
    started = time.monotonic()
    with open(os.environ["METER_STARTED"], "a", encoding="utf-8") as sink:
        sink.write(" ".join(str(v) for v in values) + "\\n")
    while os.path.exists(os.environ["METER_GATE"]) and time.monotonic() < started + 30.0:
        time.sleep(0.002)
    time.sleep({SLEEP_S} + ({SLOW_S} if {SLOW} in values else 0.0))
    raised = any(v < 0 for v in values)
    call = {{"values": values, "started": started, "ended": time.monotonic(), "raised": raised}}
    with open(os.environ["METER_CALLS"], "a", encoding="utf-8") as sink:
        sink.write(json.dumps(call) + "\\n")
    if raised:
        raise ValueError("a negative value")
    return {{"Y": x * 2}}
'''

CONFIG = f"""\
models:
  - name: metered
    kind: python
    source: metermodels:metered
    inputs: [{{name: X, datatype: INT64, shape: [1]}}]
    outputs: [{{name: Y, datatype: INT64, shape: [1]}}]
    max_batch_size: {MAX_BATCH_SIZE}
    max_delay_s: 0.002
    max_queue_size: {MAX_QUEUE_SIZE}
    executor: thread
    classes:
      - {{name: interactive, slo_s: {INTERACTIVE_SLO_S}}}
      - {{name: normal, slo_s: {NORMAL_SLO_S:.6f}}}
      - {{name: background}}
"""

INFER = "/v2/models/metered/infer"
ASGI = INFER + "?x=1"  # a query string: uvicorn's ASGI path, not the fast path


# -- the server, its model's log --------------------------------------------------------


@dataclass
class Served:
    process: ServedProcess
    started_file: Path
    calls_file: Path
    gate: Path

    @property
    def http_url(self) -> str:
        return self.process.http_url

    @property
    def grpc_url(self) -> str:
        assert self.process.grpc_url is not None
        return self.process.grpc_url

    def num_started(self) -> int:
        if not self.started_file.exists():
            return 0
        return len(self.started_file.read_text().splitlines())

    def calls(self) -> list[dict[str, Any]]:
        """Every model call that ended: values, started, ended (monotonic s), raised."""
        if not self.calls_file.exists():
            return []
        return [json.loads(line) for line in self.calls_file.read_text().splitlines()]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    (tmp_path / "metermodels.py").write_text(MODELS, encoding="utf-8")
    started, calls, gate = tmp_path / "started.txt", tmp_path / "calls.txt", tmp_path / "gate"
    env = {"METER_STARTED": str(started), "METER_CALLS": str(calls), "METER_GATE": str(gate)}
    process = start_served_process(CONFIG, tmp_path, grpc=True, env=env)
    try:
        yield Served(process, started, calls, gate)
    finally:
        gate.unlink(missing_ok=True)
        assert process.stop() == 0, process.output()


# -- the ledger: what the clients sent and saw ------------------------------------------


@dataclass
class Ledger:
    """Per class: requests the server accepted (and their items), by how they ended; the
    client-measured latency of each answered one; refusals by reason."""

    accepted: Counter[str] = field(default_factory=Counter)
    items: Counter[str] = field(default_factory=Counter)
    ok: Counter[str] = field(default_factory=Counter)
    ok_items: Counter[str] = field(default_factory=Counter)
    ok_client_s: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    ok_values: list[list[int]] = field(default_factory=list)
    failed: Counter[str] = field(default_factory=Counter)
    rejections: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class, reason)
    bad: int = 0  # malformed: refused with 400 / INVALID_ARGUMENT before any class
    refused_from_head: int = 0  # every queue full: refused from the head, class unread
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self, cls: str, values: list[int], client_s: float) -> None:
        with self.lock:
            self.accepted[cls] += 1
            self.items[cls] += len(values)
            self.ok[cls] += 1
            self.ok_items[cls] += len(values)
            self.ok_client_s[cls] += client_s
            self.ok_values.append(values)

    def dropped(self, cls: str, num_items: int, reason: str) -> None:
        """Accepted, then expired (``deadline``) or withdrawn (``cancelled``)."""
        with self.lock:
            self.accepted[cls] += 1
            self.items[cls] += num_items
            self.rejections[cls, reason] += 1

    def model_failed(self, cls: str, num_items: int) -> None:
        with self.lock:
            self.accepted[cls] += 1
            self.items[cls] += num_items
            self.failed[cls] += 1

    def refused(self, cls: str, reason: str) -> None:
        with self.lock:
            self.rejections[cls, reason] += 1


def _class_of(priority: int) -> str:
    return CLASSES[priority - 1] if 1 <= priority <= len(CLASSES) else DEFAULT_CLASS


# -- requests ---------------------------------------------------------------------------


def _body(values: list[int], parameters: dict[str, Any] | None = None) -> bytes:
    document: dict[str, Any] = {
        "inputs": [{"name": "X", "shape": [len(values), 1], "datatype": "INT64", "data": values}]
    }
    if parameters:
        document["parameters"] = parameters
    return orjson.dumps(document)


def _parameters(priority: int, timeout_us: int = 0) -> dict[str, Any]:
    parameters: dict[str, Any] = {}
    if priority:
        parameters["priority"] = priority
    if timeout_us:
        parameters["timeout"] = timeout_us
    return parameters


def _http(
    client: httpx.Client, path: str, values: list[int], priority: int = 0, timeout_us: int = 0
) -> tuple[int, Any, float]:
    """(status, document, client-measured seconds)."""
    began = time.monotonic()
    response = client.post(path, content=_body(values, _parameters(priority, timeout_us)))
    return response.status_code, response.json(), time.monotonic() - began


def _grpc(
    client: grpcclient.InferenceServerClient,
    values: list[int],
    priority: int = 0,
    timeout_us: int = 0,
) -> tuple[str, list[int], float]:
    """("OK" or the gRPC status, Y, client-measured seconds)."""
    tensor = grpcclient.InferInput("X", [len(values), 1], "INT64")
    tensor.set_data_from_numpy(np.array(values, dtype=np.int64).reshape(-1, 1))
    began = time.monotonic()
    try:
        result = client.infer("metered", [tensor], priority=priority, timeout=timeout_us or None)
    except InferenceServerException as exc:
        return str(exc.status()).removeprefix("StatusCode."), [], time.monotonic() - began
    return "OK", [int(v) for v in result.as_numpy("Y").ravel()], time.monotonic() - began


def _http_once(url: str, path: str, values: list[int], priority: int, timeout_us: int) -> int:
    """The status of one request on a connection of its own."""
    with httpx.Client(base_url=f"http://{url}", timeout=LIMIT_S) as client:
        return _http(client, path, values, priority, timeout_us)[0]


@dataclass
class Clients:
    """One HTTP and one gRPC client per thread, to one server."""

    http_url: str
    grpc_url: str
    local: threading.local = field(default_factory=threading.local)
    opened: list[Any] = field(default_factory=list)

    def http(self) -> httpx.Client:
        client = getattr(self.local, "http", None)
        if client is None:
            client = self.local.http = httpx.Client(
                base_url=f"http://{self.http_url}", timeout=LIMIT_S
            )
            self.opened.append(client)
        return client

    def grpc(self) -> grpcclient.InferenceServerClient:
        client = getattr(self.local, "grpc", None)
        if client is None:
            client = self.local.grpc = grpcclient.InferenceServerClient(self.grpc_url)
            self.opened.append(client)
        return client

    def close(self) -> None:
        for client in self.opened:
            client.close()


def send_good(
    clients: Clients, ledger: Ledger, wire: str, values: list[int], priority: int
) -> None:
    """A request that must be answered with 2 X; entered in the ledger as answered."""
    if wire == "grpc":
        status, ys, client_s = _grpc(clients.grpc(), values, priority)
        assert status == "OK", status
    else:
        code, document, client_s = _http(clients.http(), wire, values, priority)
        assert code == 200, document
        ys = [int(v) for v in document["outputs"][0]["data"]]
    assert ys == [2 * v for v in values]
    ledger.answered(_class_of(priority), values, client_s)


# -- what the server reports ------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(http_url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample of /metrics by (name, sorted labels), and each family's type."""
    response = httpx.get(f"http://{http_url}/metrics", timeout=LIMIT_S)
    assert response.status_code == 200, response.text
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
            types[sample.name] = family.type
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted({"model": "metered", **labels}.items()))]


def pending(http_url: str) -> float:
    samples, _ = scrape(http_url)
    return sum(value(samples, "carpool_pending_requests", **{"class": c}) for c in CLASSES)


def rejections(http_url: str, reason: str) -> float:
    samples, _ = scrape(http_url)
    return sum(
        value(samples, "carpool_rejections_total", reason=reason, **{"class": c}) for c in CLASSES
    )


def model_stats(http_url: str) -> dict[str, Any]:
    response = httpx.get(f"http://{http_url}/v2/models/metered/stats", timeout=LIMIT_S)
    assert response.status_code == 200, response.text
    stats: dict[str, Any] = response.json()["model_stats"][0]
    return stats


def is_cumulative(name: str, kind: str) -> bool:
    """Samples that must never go down: counters, and histograms' buckets, counts, sums."""
    return kind == "counter" or (kind == "histogram" and not name.endswith("_created"))


STATS_COUNTS = ("inference_count", "execution_count", "success", "fail", "compute_infer")


def stats_counts(http_url: str) -> dict[str, int]:
    stats = model_stats(http_url)
    inference = stats["inference_stats"]
    counts = {k: stats[k] for k in STATS_COUNTS if k in stats}
    counts |= {k: inference[k]["count"] for k in STATS_COUNTS if k in inference}
    counts |= {f"{k}_ns": inference[k]["ns"] for k in ("success", "queue", "compute_infer")}
    return counts


@dataclass
class Scraper:
    """Scrapes /metrics and /v2/models/metered/stats in turn until stopped: every scrape
    must answer 200 and parse, and no cumulative number may be lower than the time before."""

    http_url: str
    stop: threading.Event = field(default_factory=threading.Event)
    num_scrapes: int = 0
    went_down: list[str] = field(default_factory=list)

    def run(self) -> None:
        before: Samples = {}
        counts_before: dict[str, int] = {}
        while not self.stop.is_set():
            samples, types = scrape(self.http_url)
            for key, now in samples.items():
                name = key[0]
                if is_cumulative(name, types[name]) and now < before.get(key, 0.0):
                    self.went_down.append(f"{key}: {before[key]} -> {now}")
            counts = stats_counts(self.http_url)
            for name, now in counts.items():
                if now < counts_before.get(name, 0):
                    self.went_down.append(f"stats {name}: {counts_before[name]} -> {now}")
            before, counts_before = samples, counts
            self.num_scrapes += 1


# -- the phases -------------------------------------------------------------------------


def _connect(http_url: str) -> socket.socket:
    host, port = http_url.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=LIMIT_S)


def _raw(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: meter\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Held:
    """What the gated phase measured for the requests it held in the queue."""

    num_held: int
    held_s: float  # from all of them queued to the gate opening: each waited at least this
    blocker_held_s: float  # from the blocker in the model to the gate opening


def gated_phase(served: Served, clients: Clients, ledger: Ledger, pool: ThreadPoolExecutor) -> Held:
    """With one request held in the model: requests that expire in the queue, clients that
    hang up while queued, a full queue's refusals, then the held queue released."""
    url = served.http_url
    served.gate.touch()
    blocker = pool.submit(send_good, clients, ledger, INFER, [1], 0)
    wait_until(lambda: served.num_started() == 1, "the blocker in the model")
    blocker_in_s = time.monotonic()

    # Expire in the queue: 503 over HTTP, UNAVAILABLE over gRPC.
    def expire(wire: str, values: list[int], priority: int) -> int | str:
        if wire == "grpc":
            return _grpc(clients.grpc(), values, priority, 30_000)[0]
        return _http(clients.http(), wire, values, priority, 30_000)[0]

    expiring = [(INFER, [11], 1), (ASGI, [12], 3), ("grpc", [13, 14], 2)]
    answers = [pool.submit(expire, *request) for request in expiring]
    assert [f.result(LIMIT_S) for f in answers] == [503, 503, "UNAVAILABLE"]
    ledger.dropped("interactive", 1, "deadline")
    ledger.dropped("background", 1, "deadline")
    ledger.dropped("normal", 2, "deadline")
    assert pending(url) == 0

    # Hang up while queued: the fast path, the ASGI path, a cancelled gRPC call.
    for path, values, priority in ((INFER, [21], 1), (ASGI, [22, 23], 2)):
        with _connect(url) as sock:
            sock.sendall(_raw(path, _body(values, _parameters(priority))))
            wait_until(lambda: pending(url) == 1, "the request queued")
        wait_until(lambda: pending(url) == 0, "the request withdrawn")
        ledger.dropped(_class_of(priority), len(values), "cancelled")
    tensor = grpcclient.InferInput("X", [1, 1], "INT64")
    tensor.set_data_from_numpy(np.array([[24]], dtype=np.int64))
    cancelled = threading.Event()
    context = clients.grpc().async_infer(
        "metered", [tensor], lambda result, error: cancelled.set(), priority=3
    )
    wait_until(lambda: pending(url) == 1, "the gRPC request queued")
    context.cancel()
    assert cancelled.wait(LIMIT_S)
    wait_until(lambda: pending(url) == 0, "the gRPC request withdrawn")
    ledger.dropped("background", 1, "cancelled")

    # Fill the queue (one request per wire and priority), then three more are refused.
    fill = [(INFER, [31], 1), (INFER, [32], 3), (ASGI, [33], 2), (ASGI, [34], 0)]
    fill += [("grpc", [35], 1), ("grpc", [36], 3)]
    assert len(fill) == MAX_QUEUE_SIZE
    held = [pool.submit(send_good, clients, ledger, w, v, p) for w, v, p in fill]
    wait_until(lambda: pending(url) == MAX_QUEUE_SIZE, "the queue full")
    queued_s = time.monotonic()
    with httpx.Client(base_url=f"http://{url}", timeout=LIMIT_S) as client:
        for path, priority in ((INFER, 1), (ASGI, 3)):
            code, document, _ = _http(client, path, [41], priority)
            assert code == 429, document
            if path == INFER:  # refused from its head: its class was never read
                ledger.refused_from_head += 1
            else:
                ledger.refused(_class_of(priority), "queue_full")
    status, _, _ = _grpc(clients.grpc(), [42], 2)
    assert status == "UNAVAILABLE"
    ledger.refused("normal", "queue_full")

    opened_s = time.monotonic()
    served.gate.unlink()
    for future in [blocker, *held]:
        future.result(LIMIT_S)
    return Held(MAX_QUEUE_SIZE, opened_s - queued_s, opened_s - blocker_in_s)


def load_phase(clients: Clients, ledger: Ledger, pool: ThreadPoolExecutor) -> None:
    """Good requests at every priority over every wire, four at a time (never more than
    the queue holds)."""
    wires = (INFER, ASGI, "grpc")
    plan = []
    next_value = 1000
    for i in range(48):
        k = 1 + i % 3
        plan.append((wires[i % 3], list(range(next_value, next_value + k)), i % 4))
        next_value += k
    futures = []
    for start in range(4):
        chunk = plan[start::4]
        futures.append(
            pool.submit(lambda chunk=chunk: [send_good(clients, ledger, *r) for r in chunk])
        )
    for future in futures:
        future.result(LIMIT_S * 2)


def malformed_phase(served: Served, ledger: Ledger) -> None:
    """Refused as malformed (400 / INVALID_ARGUMENT) before they are queued: not counted,
    as in Triton, but for an unknown priority class."""
    bad = [
        (INFER, b'{"inputs": [{"name": "X",'),
        (ASGI, orjson.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32",
                                          "data": [1.0]}]})),
        (INFER, orjson.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "INT64",
                                           "data": [1, 2]}]})),
        (ASGI, _body([1], {"priority": -1})),
        (INFER, _body([1], {"timeout": -5})),
    ]  # fmt: skip
    with httpx.Client(base_url=f"http://{served.http_url}", timeout=LIMIT_S) as client:
        for path, content in bad:
            response = client.post(path, content=content)
            assert response.status_code == 400, response.text
            ledger.bad += 1
    # A priority naming no class passes the server's checks; the batcher refuses it, as
    # `invalid` in the default class (docs/server.md).
    with httpx.Client(base_url=f"http://{served.http_url}", timeout=LIMIT_S) as client:
        response = client.post(INFER, content=_body([1], {"priority": "urgent"}))
    assert response.status_code == 400, response.text
    ledger.refused(DEFAULT_CLASS, "invalid")
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("metered", [tensor])
    finally:
        client.close()
    assert str(caught.value.status()) == "StatusCode.INVALID_ARGUMENT"
    ledger.bad += 1


def poison_phase(clients: Clients, ledger: Ledger) -> None:
    """Requests the model raises on, one at a time: each is a batch of its own, run once."""
    code, document, _ = _http(clients.http(), INFER, [-1], 1)
    assert code == 500, document
    ledger.model_failed("interactive", 1)
    code, document, _ = _http(clients.http(), ASGI, [-2, 5], 3)
    assert code == 500, document
    ledger.model_failed("background", 2)
    status, _, _ = _grpc(clients.grpc(), [-3], 2)
    assert status == "INTERNAL"
    ledger.model_failed("normal", 1)


# -- the test ---------------------------------------------------------------------------


def test_every_reported_number_matches_what_clients_and_model_saw(served: Served) -> None:
    url = served.http_url
    began_unix_s = time.time()
    began_s = time.monotonic()
    ledger = Ledger()
    clients = Clients(url, served.grpc_url)
    scraper = Scraper(url)
    with ThreadPoolExecutor(max_workers=12) as pool:
        try:
            scraping = pool.submit(scraper.run)  # all along: no scrape fails or blocks
            held = gated_phase(served, clients, ledger, pool)
            load_phase(clients, ledger, pool)
            malformed_phase(served, ledger)
            poison_phase(clients, ledger)
            scraper.stop.set()
            scraping.result(LIMIT_S)
        finally:
            scraper.stop.set()
            clients.close()
    elapsed_s = time.monotonic() - began_s

    calls = served.calls()
    stats = model_stats(url)
    samples, types = scrape(url)
    assert scraper.num_scrapes > 0 and not scraper.went_down, scraper.went_down
    check_classes(samples, ledger)
    check_batches(samples, calls)
    check_times(samples, ledger, calls, held, elapsed_s)
    check_triton_stats(stats, samples, ledger, calls, began_unix_s)
    check_consistency(samples, types)


def per_class(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    return {c: value(samples, name, **{"class": c}, **labels) for c in CLASSES}


def check_classes(samples: Samples, ledger: Ledger) -> None:
    """Requests, items, outcomes and refusals by class, as the ledger has them."""
    assert per_class(samples, "carpool_requests_total") == {c: ledger.accepted[c] for c in CLASSES}
    assert per_class(samples, "carpool_request_items_total") == {
        c: ledger.items[c] for c in CLASSES
    }
    assert per_class(samples, "carpool_requests_completed_total") == {
        c: ledger.ok[c] for c in CLASSES
    }
    assert per_class(samples, "carpool_requests_failed_total") == {
        c: ledger.failed[c] for c in CLASSES
    }
    for reason in ("cancelled", "closed", "deadline", "invalid", "queue_full"):
        reported = per_class(samples, "carpool_rejections_total", reason=reason)
        assert reported == {c: ledger.rejections[c, reason] for c in CLASSES}, reason
    assert value(samples, "carpool_refused_from_head_total") == ledger.refused_from_head
    assert per_class(samples, "carpool_pending_requests") == dict.fromkeys(CLASSES, 0)
    for name in ("carpool_request_latency_seconds", "carpool_queue_wait_seconds"):
        assert per_class(samples, name + "_count") == {c: ledger.ok[c] for c in CLASSES}, name
    # Answered within the SLO / (answered + expired): every interactive answer met 30 s,
    # no normal one met 1 µs, background has no SLO (no series).
    expired = ledger.rejections["interactive", "deadline"]
    slo = per_class_present(samples, "carpool_slo_attainment")
    assert slo == {
        "interactive": ledger.ok["interactive"] / (ledger.ok["interactive"] + expired),
        "normal": 0.0,
    }


def per_class_present(samples: Samples, name: str) -> dict[str, float]:
    found = {}
    for c in CLASSES:
        key = (name, tuple(sorted({"model": "metered", "class": c}.items())))
        if key in samples:
            found[c] = samples[key]
    return found


def check_batches(samples: Samples, calls: list[dict[str, Any]]) -> None:
    """Each model call was one batch (nothing was bisected or dropped after it closed):
    their number, sizes and fill as the model saw them."""
    sizes = [len(call["values"]) for call in calls]
    assert value(samples, "carpool_batches_total") == len(sizes)
    assert value(samples, "carpool_batch_size_count") == len(sizes)
    assert value(samples, "carpool_batch_size_sum") == sum(sizes)
    for bound in (1, 2, 4, 8, 16, 1024):
        reported = value(samples, "carpool_batch_size_bucket", le=f"{float(bound)}")
        assert reported == sum(size <= bound for size in sizes), bound
    assert value(samples, "carpool_batch_size_bucket", le="+Inf") == len(sizes)
    # docs/core.md: batch size / max batch size (one max for every class here).
    fill = value(samples, "carpool_fill_ratio")
    assert fill == pytest.approx(sum(sizes) / len(sizes) / MAX_BATCH_SIZE, rel=1e-12)
    assert value(samples, "carpool_batch_compute_seconds_count") == len(sizes)
    assert value(samples, "carpool_replica_balance") == 1.0  # one replica


def check_times(
    samples: Samples,
    ledger: Ledger,
    calls: list[dict[str, Any]],
    held: Held,
    elapsed_s: float,
) -> None:
    """Sums of seconds, bounded by what the model and the clients measured."""
    compute_s = value(samples, "carpool_batch_compute_seconds_sum")
    in_model_s = sum(call["ended"] - call["started"] for call in calls)
    assert len(calls) * SLEEP_S <= in_model_s <= compute_s <= elapsed_s
    busy = value(samples, "carpool_replica_busy_fraction", replica="0")
    effective = value(samples, "carpool_effective_compute_ratio")
    assert 0 < busy <= 1 and 0 < effective <= 1
    latency = per_class(samples, "carpool_request_latency_seconds_sum")
    queue = per_class(samples, "carpool_queue_wait_seconds_sum")
    for c in CLASSES:
        # Each answer waited for its batch's call (at least SLEEP_S) after its batch
        # closed; the server saw less of each request's life than its client did.
        assert queue[c] + ledger.ok[c] * SLEEP_S <= latency[c] <= ledger.ok_client_s[c], c
    # The held requests waited in the queue, the blocker in the model, until the gate opened.
    assert sum(queue.values()) >= held.num_held * held.held_s
    assert latency["normal"] >= held.blocker_held_s


def check_triton_stats(
    stats: dict[str, Any],
    samples: Samples,
    ledger: Ledger,
    calls: list[dict[str, Any]],
    began_unix_s: float,
) -> None:
    """/v2/models/metered/stats: Triton's counts from the same truth, its durations the
    same sums as /metrics (in integer nanoseconds)."""
    num_ok = sum(ledger.ok.values())
    assert stats["inference_count"] == sum(ledger.ok_items.values())
    assert stats["execution_count"] == sum(not call["raised"] for call in calls)
    assert began_unix_s * 1e3 <= stats["last_inference"] <= time.time() * 1e3
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == num_ok
    # Failed: the model raised, or accepted then expired or withdrawn, or refused (429).
    assert inference["fail"] == {
        "count": sum(ledger.failed.values()) + sum(ledger.rejections.values()),
        "ns": 0,
    }
    latency_s = sum(per_class(samples, "carpool_request_latency_seconds_sum").values())
    queue_s = sum(per_class(samples, "carpool_queue_wait_seconds_sum").values())
    assert inference["success"]["ns"] == pytest.approx(latency_s * 1e9, abs=1)
    # Triton's queue runs to the call's start: a closed batch's wait for the replica too.
    assert inference["queue"]["count"] == num_ok
    assert queue_s * 1e9 - 1 <= inference["queue"]["ns"]
    assert inference["queue"]["ns"] + inference["compute_infer"]["ns"] <= inference["success"]["ns"]
    # As Triton: per successful request, its model call's time (here each call enclosed
    # the model's own measure of itself, and lay within the request's latency).
    call_s = {v: call["ended"] - call["started"] for call in calls for v in call["values"]}
    in_model_ns = sum(call_s[values[0]] for values in ledger.ok_values) * 1e9
    assert inference["compute_input"] == {"count": num_ok, "ns": 0}
    assert inference["compute_output"] == {"count": num_ok, "ns": 0}
    assert inference["compute_infer"]["count"] == num_ok
    assert in_model_ns <= inference["compute_infer"]["ns"] <= inference["success"]["ns"]
    # batch_stats: the executions execution_count counts (those with an answer), by size.
    ran = [call for call in calls if not call["raised"]]
    by_size = {b["batch_size"]: b for b in stats["batch_stats"]}
    assert {size: b["compute_infer"]["count"] for size, b in by_size.items()} == Counter(
        len(call["values"]) for call in ran
    )
    assert sum(b["compute_infer"]["count"] for b in by_size.values()) == stats["execution_count"]
    per_size_ns = sum(b["compute_infer"]["ns"] for b in by_size.values())
    ran_ns = sum(call["ended"] - call["started"] for call in ran) * 1e9
    compute_ns = value(samples, "carpool_batch_compute_seconds_sum") * 1e9
    assert ran_ns <= per_size_ns <= compute_ns + len(by_size)


def check_consistency(samples: Samples, types: dict[str, str]) -> None:
    """Every histogram's buckets rise to its count."""
    num_checked = 0
    for (name, labels), count in samples.items():
        if not name.endswith("_count") or types.get(name) != "histogram":
            continue
        base = name.removesuffix("_count")
        buckets = sorted(
            (float(dict(key[1])["le"]), v)
            for key, v in samples.items()
            if key[0] == base + "_bucket" and {k: x for k, x in key[1] if k != "le"} == dict(labels)
        )
        values = [v for _, v in buckets]
        assert values == sorted(values) and values[-1] == count, (name, labels)
        num_checked += 1
    assert num_checked == 2 * len(CLASSES) + 2  # latency and queue wait by class; batches


def test_a_batch_whose_requests_all_expired_before_its_turn_is_not_counted_as_run(
    served: Served,
) -> None:
    """A full batch may wait on the replica's thread behind the one computing; when the
    deadlines of all its requests pass meanwhile, the model never sees it: no batch ran."""
    url = served.http_url
    ledger = Ledger()
    clients = Clients(url, served.grpc_url)
    half = MAX_BATCH_SIZE // 2
    served.gate.touch()
    with ThreadPoolExecutor(max_workers=6) as pool:
        try:
            blocker = pool.submit(send_good, clients, ledger, INFER, [1], 0)
            wait_until(lambda: served.num_started() == 1, "the blocker in the model")
            # Queued behind the blocker: a full interactive batch that computes SLOW_S,
            # and a full background batch that may wait half of that, not all of it.
            slow = [SLOW, *range(101, 100 + half)]
            full = [
                pool.submit(send_good, clients, ledger, INFER, values, 1)
                for values in (slow, list(range(200, 200 + half)))
            ]
            late = [
                pool.submit(_http_once, url, INFER, values, 3, int(SLOW_S / 2 * 1e6))
                for values in (list(range(300, 300 + half)), list(range(400, 400 + half)))
            ]
            wait_until(lambda: pending(url) == 4, "four requests queued")
            served.gate.unlink()
            for future in [blocker, *full]:
                future.result(LIMIT_S)
            assert [f.result(LIMIT_S) for f in late] == [503, 503]
        finally:
            clients.close()
    calls = served.calls()
    assert sorted(len(call["values"]) for call in calls) == [1, MAX_BATCH_SIZE]
    samples, _ = scrape(url)
    assert rejections(url, "deadline") == 2
    check_batches(samples, calls)
    stats = model_stats(url)
    assert stats["inference_stats"]["compute_infer"]["count"] == 3  # the answered requests
    assert stats["execution_count"] == 2
    assert [b["batch_size"] for b in stats["batch_stats"]] == [1, MAX_BATCH_SIZE]
    assert all(b["compute_infer"]["count"] == 1 for b in stats["batch_stats"])


def test_triton_compute_stats_are_per_successful_request_and_batch_stats_per_execution(
    served: Served,
) -> None:
    """Triton's compute_* counts are its successful requests (success.count), each adding
    its execution's time; batch_stats are the executions that execution_count counts (one
    that only failed is in neither)."""
    url = served.http_url
    ledger = Ledger()
    clients = Clients(url, served.grpc_url)
    served.gate.touch()
    with ThreadPoolExecutor(max_workers=4) as pool:
        try:
            blocker = pool.submit(send_good, clients, ledger, INFER, [1], 0)
            wait_until(lambda: served.num_started() == 1, "the blocker in the model")
            batched = [pool.submit(send_good, clients, ledger, INFER, [v], 0) for v in (2, 3, 4)]
            wait_until(lambda: pending(url) == 3, "three requests queued")
            served.gate.unlink()
            for future in [blocker, *batched]:
                future.result(LIMIT_S)
            poison_phase(clients, Ledger())
        finally:
            clients.close()
    calls = served.calls()
    assert [len(call["values"]) for call in calls] == [1, 3, 1, 2, 1]
    stats = model_stats(url)
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 4
    assert [inference[k]["count"] for k in ("queue", "compute_input", "compute_infer")] == [4] * 3
    # The batch of three: its time once per request in it.
    in_model_ns = sum((c["ended"] - c["started"]) * len(c["values"]) for c in calls[:2]) * 1e9
    assert inference["compute_infer"]["ns"] >= in_model_ns
    assert stats["execution_count"] == 2 and stats["inference_count"] == 4
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (1, 1),
        (3, 1),
    ]
