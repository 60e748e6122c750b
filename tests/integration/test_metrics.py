"""`carpool serve` (built-in models) read as a Prometheus user reads it: a known mix of
KServe, embeddings and streamed generation requests moves ``/metrics`` by exactly what was
sent, scrapes during the load all parse, the gauges settle back at idle, no value is
negative or NaN, client input cannot add series, and a scrape negotiates what
prometheus_client's own handler does (gzip, ``name[]``, OpenMetrics)."""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from .conftest import ServedProcess, start_served_process, wait_until

LIMIT_S = 60.0  # only against hangs
MLP, EMBEDDER, LLAMA = "mlp", "all-MiniLM-L6-v2", "tiny-random-llama"
CLASSES = {"interactive", "normal", "background"}
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)

Key = tuple[str, tuple[tuple[str, str], ...]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    server = start_served_process(None, tmp_path_factory.mktemp("metrics_review"))
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture
def http(served: ServedProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{served.http_url}", timeout=LIMIT_S) as client:
        yield client


def _families(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))


def _samples(client: httpx.Client) -> dict[Key, float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in _families(response.text)
        for s in family.samples
    }


def _value(samples: dict[Key, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _mlp_body(rows: int, **parameters: object) -> dict[str, object]:
    tensor = {
        "name": "INPUT0",
        "datatype": "FP32",
        "shape": [rows, 256],
        "data": [0.5] * rows * 256,
    }
    return {"inputs": [tensor], "parameters": parameters}


def _stream_completion(client: httpx.Client, max_tokens: int) -> dict[str, object]:
    """A streamed /v1/completions; its usage (asked with include_usage) and its
    ``finish_reason``."""
    body = {
        "model": LLAMA,
        "prompt": "the metrics say",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, object] = {}
    finish_reason = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line.removeprefix("data: "))
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    finish_reason = choice.get("finish_reason") or finish_reason
    assert usage and finish_reason, "the stream ended without usage or finish_reason"
    return {**usage, "finish_reason": finish_reason}


def _is_idle(client: httpx.Client) -> bool:
    samples = _samples(client)
    gauges = (
        "carpool_pending_requests",
        "carpool_generation_requests_running",
        "carpool_generation_requests_waiting",
        "carpool_generation_kv_cache_usage_ratio",
    )
    return all(value == 0 for (name, _), value in samples.items() if name in gauges)


def test_a_known_mix_moves_the_metrics_by_exactly_what_was_sent(
    served: ServedProcess, http: httpx.Client
) -> None:
    before = _samples(http)
    stop = threading.Event()
    scrapes: list[str] = []

    def scrape_until_stopped() -> None:
        with httpx.Client(base_url=f"http://{served.http_url}", timeout=LIMIT_S) as client:
            while not stop.is_set():
                response = client.get("/metrics", headers={"accept-encoding": "gzip"})
                assert response.status_code == 200
                scrapes.append(response.text)  # httpx inflates it

    num_mlp, rows = 6, 3
    with ThreadPoolExecutor(4) as pool:
        scraper = pool.submit(scrape_until_stopped)
        try:
            calls = [
                pool.submit(http.post, f"/v2/models/{MLP}/infer", json=_mlp_body(rows, priority=1))
                for _ in range(num_mlp)
            ]
            embedded = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["a", "b c"]})
            usage = _stream_completion(http, max_tokens=5)
            assert all(c.result().status_code == 200 for c in calls)
            assert embedded.status_code == 200, embedded.text
        finally:
            stop.set()
            scraper.result()
    wait_until(lambda: _is_idle(http), "every queue, running batch and KV block to empty")
    after = _samples(http)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    mlp = {"model": MLP, "class": "interactive"}  # Triton priority 1
    assert delta("carpool_requests_total", **mlp) == num_mlp
    assert delta("carpool_request_items_total", **mlp) == num_mlp * rows
    assert delta("carpool_requests_completed_total", **mlp) == num_mlp
    assert delta("carpool_request_latency_seconds_count", **mlp) == num_mlp
    assert delta("carpool_batch_size_sum", model=MLP) == num_mlp * rows
    assert delta("carpool_batch_size_count", model=MLP) == delta("carpool_batches_total", model=MLP)
    # One replica: the seconds it computed are its batches' compute seconds, as counters
    # (rate() of them is the busy fraction over a window).
    busy = delta("carpool_replica_busy_seconds_total", model=MLP, replica="0")
    assert busy > 0
    assert busy == pytest.approx(delta("carpool_batch_compute_seconds_sum", model=MLP))
    # Embeddings: each text is its own request (docs/embeddings.md); its tokens all batched.
    texts = {"model": EMBEDDER, "class": "normal"}
    assert delta("carpool_requests_total", **texts) == 2
    assert delta("carpool_requests_completed_total", **texts) == 2
    prompt_tokens = embedded.json()["usage"]["prompt_tokens"]
    assert delta("carpool_batch_tokens_total", model=EMBEDDER) == prompt_tokens
    # Generation, in vLLM's terms, against the stream's own usage.
    llama = {"model": LLAMA}
    assert delta("carpool_generation_prompt_tokens_total", **llama) == usage["prompt_tokens"]
    assert delta("carpool_generation_tokens_total", **llama) == usage["completion_tokens"]
    finished = "carpool_generation_requests_finished_total"
    assert delta(finished, finished_reason=str(usage["finish_reason"]), **llama) == 1
    assert delta("carpool_generation_time_to_first_token_seconds_count", **llama) == 1
    assert delta("carpool_generation_e2e_request_latency_seconds_count", **llama) == 1
    # One token per step after the first: one inter-token sample each.
    itl = delta("carpool_generation_inter_token_latency_seconds_count", **llama)
    assert itl == int(str(usage["completion_tokens"])) - 1

    assert scrapes, "no scrape ran during the load"
    for text in scrapes:
        _families(text)  # each parses
    for (name, labels), value in after.items():
        assert not math.isnan(value) and value >= 0, (name, labels, value)
        if name.endswith(("_ratio", "_fraction", "_attainment", "_balance", "_volatility")):
            assert value <= 1, (name, labels, value)


def test_a_generation_model_has_only_its_engines_series(http: httpx.Client) -> None:
    # Its batcher only starts and stops the engine: its requests, batches and replica
    # series would read 0 (an idle replica, no requests) however busy the engine is.
    _stream_completion(http, max_tokens=2)
    samples = _samples(http)
    llama = {name for (name, labels), _ in samples.items() if ("model", LLAMA) in labels}
    assert llama and all(name.startswith("carpool_generation_") for name in llama), llama
    assert ("carpool_requests_total", (("class", "normal"), ("model", MLP))) in samples


def test_names_types_and_help_follow_prometheus_conventions(http: httpx.Client) -> None:
    families = _families(http.get("/metrics").text)
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    owners: dict[str, str] = {}
    for family in families:
        assert family.name.startswith("carpool_")
        for sample in family.samples:
            assert owners.setdefault(sample.name, family.name) == family.name, sample.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.name.endswith("_seconds"):
            # Durations are histograms or counters; a gauge only for a setting in force
            # (the adaptive controller's delay, its fitted batch-time line).
            settings = ("carpool_adaptive_", "carpool_batch_time_fit_")
            is_setting = family.type == "gauge" and family.name.startswith(settings)
            assert family.type in ("histogram", "counter") or is_setting, family.name
            assert "seconds" in family.documentation.lower(), (family.name, family.documentation)
        if family.name.endswith(("_ratio", "_fraction", "_attainment")):
            assert family.type == "gauge", family.name
            assert "0 to 1" in family.documentation, (family.name, family.documentation)
    latency = next(f for f in families if f.name == "carpool_request_latency_seconds")
    bounds = sorted(float(s.labels["le"]) for s in latency.samples if s.name.endswith("_bucket"))
    assert bounds[0] <= 0.001 and bounds[-2] >= 10 and bounds[-1] == math.inf
    sizes = next(f for f in families if f.name == "carpool_batch_size")
    mlp_bounds = {s.labels.get("le") for s in sizes.samples if s.labels["model"] == MLP}
    assert {"1.0", "63.0", "64.0", "+Inf"} <= mlp_bounds  # the built-in mlp batches up to 64


def test_client_input_never_adds_a_series(http: httpx.Client) -> None:
    # Unknown model names (KServe path, OpenAI "model"), priorities that name no class,
    # request ids and paths: each is refused or served under a known class, never a label.
    _stream_completion(http, max_tokens=1)  # every series a served request can add
    http.post(f"/v2/models/{MLP}/infer", json=_mlp_body(1))
    http.post(f"/v2/models/{MLP}/infer", json=_mlp_body(1, priority=1))  # its SLO series
    before = set(_samples(http))
    for _ in range(25):
        bogus = uuid.uuid4().hex
        answers = [
            http.post(f"/v2/models/{bogus}/infer", json=_mlp_body(1)),
            http.post(f"/v2/models/{MLP}/versions/{bogus}/infer", json=_mlp_body(1)),
            http.post(f"/v2/models/{MLP}/infer", json=_mlp_body(1, priority=bogus)),
            http.post(f"/v2/models/{MLP}/infer", json={**_mlp_body(1, priority=1), "id": bogus}),
            http.post("/v1/embeddings", json={"model": bogus, "input": "x"}),
            http.post("/v1/completions", json={"model": bogus, "prompt": "x", "max_tokens": 1}),
            http.get(f"/{bogus}"),
            http.get(f"/metrics/{bogus}"),
        ]
        assert {a.status_code for a in answers} <= {200, 400, 404}
    samples = _samples(http)
    assert set(samples) == before
    for name, labels in samples:
        values = dict(labels)
        assert values.get("model", MLP) in {MLP, EMBEDDER, LLAMA}, (name, values)
        assert values.get("class", "normal") in CLASSES, (name, values)


def test_gzip_is_served_when_the_scraper_accepts_it(http: httpx.Client) -> None:
    # Prometheus sends "Accept-Encoding: gzip"; prometheus_client's handler honours it.
    for accept in ("text/plain", PROMETHEUS_ACCEPT):
        response = http.get("/metrics", headers={"accept-encoding": "gzip", "accept": accept})
        assert response.status_code == 200
        assert response.headers["content-encoding"] == "gzip"
        # httpx inflated it; the bytes on the wire were gzip: the text parses.
        assert len(response.content) > int(response.headers["content-length"])
        if accept == PROMETHEUS_ACCEPT:
            assert response.text.endswith("# EOF\n")
            assert list(om_parser.text_string_to_metric_families(response.text))
        else:
            assert _families(response.text)
    plain = http.get("/metrics", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers
    head = http.head("/metrics", headers={"accept-encoding": "gzip"})
    assert head.status_code == 200 and head.headers["content-encoding"] == "gzip"


def test_name_query_keeps_only_the_samples_so_named(http: httpx.Client) -> None:
    # As prometheus_client's handler: /metrics?name[]=a&name[]=b.
    response = http.get(
        "/metrics",
        params=[("name[]", "carpool_batches_total"), ("name[]", "carpool_pending_requests")],
    )
    assert response.status_code == 200
    found: set[str] = {s.name for f in _families(response.text) for s in f.samples}
    assert found == {"carpool_batches_total", "carpool_pending_requests"}
    openmetrics = http.get(
        "/metrics",
        params={"name[]": "carpool_batches_total"},
        headers={"accept": PROMETHEUS_ACCEPT},
    )
    om_samples: list[Sample] = [
        s for f in om_parser.text_string_to_metric_families(openmetrics.text) for s in f.samples
    ]
    assert {s.name for s in om_samples} == {"carpool_batches_total"}
