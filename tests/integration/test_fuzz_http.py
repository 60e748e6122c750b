"""Every HTTP route of one real `carpool serve` (the built-in models) fuzzed with
hypothesis: KServe infer as JSON and as binary tensors, model and server metadata,
readiness, statistics and configuration, the repository index and the extensions carpool
does not serve, OpenAI embeddings, completions and chat (streamed or not), the batch
policy, /metrics, and any method on any path with any body.

Properties, for every case: the answer is a result or a 4xx, never a 5xx except those
documented (501 for an unimplemented Triton extension, 503 for overload or a deadline);
an error comes as JSON with an ``error`` (KServe: a message, OpenAI: an object with
one); /metrics always parses as Prometheus text; after each property the server still
answers its readiness probe; over the module its RSS grows at most 50 MiB
(fuzzing.MAX_RSS_GROWTH_KIB). Examples per property: ``CARPOOL_FUZZ_EXAMPLES``.

The policy route changes the live server: each accepted change is undone at once (the
policy read before is posted back), so later cases meet the built-in policy. Where
`carpool serve` has ``--allow-policy-updates`` the server runs with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from carpool.config import POLICY_FIELDS

from .fuzzing import (
    EMBEDDINGS,
    GENERATION,
    JSON_SCALARS,
    JSON_VALUES,
    MLP,
    MODEL_NAMES,
    SETTINGS,
    Fuzzed,
    check_memory,
    fuzzed_server,
    is_http_fault,
    json_text,
)

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES"]  # fmt: skip
TIMEOUT_S = 60.0  # a net against a hang, never a timing assertion
# What a client library lets through as a header value: printable ASCII, not padded.
HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(
    str.strip
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    with fuzzed_server(tmp_path_factory.mktemp("fuzz-http"), "test_fuzz_http") as server:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as client:
            _warm_up(client)
        server.log.rss_start_kib = server.rss_kib()
        yield server


@pytest.fixture(scope="module")
def client(fuzzed: Fuzzed) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzzed.url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(autouse=True)
def _still_serving(fuzzed: Fuzzed) -> Iterator[None]:
    yield
    fuzzed.check_alive()


def _warm_up(client: httpx.Client) -> None:
    """One good request of each kind: the first of each allocates for good (tokenizer,
    model buffers), which is not growth the fuzzing caused."""
    row = [0.5] * 256
    infer = {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": row}]}
    for _ in range(3):
        assert client.post(f"/v2/models/{MLP}/infer", json=infer).status_code == 200
        embed = {"model": EMBEDDINGS, "input": ["warm", "up " * 30]}
        assert client.post("/v1/embeddings", json=embed).status_code == 200
        prompt = {"model": GENERATION, "prompt": "warm", "max_tokens": 4}
        assert client.post("/v1/completions", json=prompt).status_code == 200
        assert client.get("/metrics").status_code == 200


def _check(fuzzed: Fuzzed, response: httpx.Response, what: str) -> None:
    """A result or a documented error, and an error as JSON naming it."""
    status = response.status_code
    sent = f"{response.request.method} {response.request.url.raw_path[:200]!r} {what}"
    is_fault = is_http_fault(status)
    assert fuzzed.log.saw(status, sent, is_fault=is_fault), f"{sent} -> {response.text[:500]}"
    if status < 400 or response.request.method == "HEAD":
        return
    if not response.content and response.request.url.path.endswith("/ready"):
        return  # readiness says "not ready" with a bare status, as Triton does
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        problem = f"{sent} -> {status} without a JSON error: {response.text[:300]}"
        raise AssertionError(problem) from None
    if isinstance(error, dict):  # OpenAI's error object
        error = error.get("message")
    assert isinstance(error, str) and error, (sent, response.text[:300])


# -- KServe infer -----------------------------------------------------------------------

DIMS = st.integers(-2, 4) | st.sampled_from([256, 2**31, 2**63 - 1, -(2**63)])
SHAPES = st.lists(DIMS, max_size=4)


def _size(shape: list[int]) -> int | None:
    """Elements in ``shape`` when it is small and valid, else None."""
    if any(d < 0 for d in shape):
        return None
    size = int(np.prod(shape, dtype=object)) if shape else 1
    return size if size <= 2048 else None


def _element(datatype: str) -> st.SearchStrategy[Any]:
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":
        return st.text(max_size=8)
    if datatype.startswith(("FP", "BF")):
        return st.floats(allow_nan=False, allow_infinity=False, width=32)
    return st.integers(-(2**64), 2**64)


@st.composite
def tensors(draw: st.DrawFn, *, binary: bool) -> tuple[dict[str, Any], bytes]:
    """A KServe input tensor (and its binary data): mostly close to mlp's INPUT0 (FP32
    [n, 256]) so that the decoder gets deep, with every field open to anything."""
    if draw(st.booleans()):
        name, datatype, shape = "INPUT0", "FP32", [draw(st.integers(0, 3)), 256]
    else:
        name = draw(st.sampled_from(["INPUT0", "OUTPUT0", ""]) | st.text(max_size=8))
        datatype = draw(st.sampled_from(DATATYPES) | st.text(max_size=5))
        shape = draw(SHAPES)
    tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    size = _size(shape)
    data = b""
    if binary:
        itemsize = {"BOOL": 1, "UINT8": 1, "INT8": 1, "FP16": 2, "BF16": 2, "UINT16": 2,
                    "INT16": 2, "FP64": 8, "INT64": 8, "UINT64": 8}.get(datatype, 4)  # fmt: skip
        fit = size * itemsize if size is not None else draw(st.integers(0, 64))
        data = draw(st.binary(min_size=fit, max_size=fit) | st.binary(max_size=64))
        declared = draw(st.sampled_from([len(data)]) | st.integers(-2, 2**40) | JSON_SCALARS)
        tensor["parameters"] = {"binary_data_size": declared}
    elif size is not None and draw(st.integers(0, 3)):
        flat = draw(st.lists(_element(datatype), min_size=size, max_size=size))
        nested = shape and size  # [2**31, 0] nested would be 2**31 empty lists: sent flat
        tensor["data"] = np.array(flat, dtype=object).reshape(shape).tolist() if nested else flat
    else:
        tensor["data"] = draw(JSON_VALUES)
    if draw(st.integers(0, 4)) == 0:
        key = draw(st.sampled_from(["name", "datatype", "shape", "data", "parameters"]))
        if draw(st.booleans()):
            tensor.pop(key, None)
        else:
            tensor[key] = draw(JSON_VALUES)
    return tensor, data


@st.composite
def infer_documents(draw: st.DrawFn, *, binary: bool) -> tuple[dict[str, Any], bytes]:
    pairs = draw(st.lists(tensors(binary=binary), min_size=0, max_size=3))
    document: dict[str, Any] = {"inputs": [tensor for tensor, _ in pairs]}
    if draw(st.booleans()):
        document["id"] = draw(JSON_SCALARS)
    if draw(st.booleans()):
        output: dict[str, Any] = {"name": draw(st.sampled_from(["OUTPUT0", "x"]))}
        names = ["binary_data", "classification", "bogus"]
        output["parameters"] = draw(st.dictionaries(st.sampled_from(names), JSON_SCALARS))
        document["outputs"] = [output]
    if draw(st.booleans()):
        names = ["timeout", "priority", "binary_data_output", "sequence_id", "x"]
        document["parameters"] = draw(st.dictionaries(st.sampled_from(names), JSON_SCALARS))
    return document, b"".join(data for _, data in pairs)


INFER_PATHS = st.builds(
    lambda model, version: (
        f"/v2/models/{quote(model, safe='')}"
        + ("" if version is None else f"/versions/{quote(version, safe='')}")
        + "/infer"
    ),
    st.sampled_from([MLP, MLP, MLP, EMBEDDINGS, GENERATION]) | MODEL_NAMES,
    st.none() | st.sampled_from(["1", "2", ""]) | st.text(max_size=4),
)


@SETTINGS
@given(path=INFER_PATHS, case=infer_documents(binary=False), data=st.data())
def test_kserve_json_infer_is_a_result_or_a_4xx(
    fuzzed: Fuzzed, client: httpx.Client, path: str, case: Any, data: st.DataObject
) -> None:
    document, _ = case
    document = data.draw(st.sampled_from([document] * 4) | JSON_VALUES)
    body = data.draw(json_text(document))
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    _check(fuzzed, response, repr(body[:300]))
    if response.status_code == 200:
        assert isinstance(response.json()["outputs"], list)


@SETTINGS
@given(path=INFER_PATHS, case=infer_documents(binary=True), data=st.data())
def test_kserve_binary_infer_is_a_result_or_a_4xx(
    fuzzed: Fuzzed, client: httpx.Client, path: str, case: Any, data: st.DataObject
) -> None:
    document, tail = case
    header = data.draw(json_text(document))
    length = data.draw(
        st.sampled_from([str(len(header))] * 4)
        | st.integers(-5, len(header) + len(tail) + 5).map(str)
        | HEADER_TEXT
    )
    headers = {"inference-header-content-length": length}
    if data.draw(st.booleans()):
        headers["content-type"] = "application/octet-stream"
    response = client.post(path, content=header + tail, headers=headers)
    _check(fuzzed, response, f"length {length!r} {header[:200]!r} + {len(tail)} bytes")


# -- metadata, readiness, statistics, extensions ----------------------------------------

METHODS = st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
SEGMENT = st.sampled_from(["", "ready", "config", "stats", "versions", "1", "infer", "policy",
                           "live", "health", "trace", "setting", "load", "unload", "index",
                           "status", "register", "x"]) | st.text(max_size=6)  # fmt: skip
ROUTE_ROOTS = st.sampled_from([
    "/v2", "/v2/health", "/v2/models", "/v2/models/stats", "/v2/repository", "/v2/repository/index",
    "/v2/repository/models/mlp", "/v2/systemsharedmemory", "/v2/cudasharedmemory", "/v2/trace",
    "/v2/logging", "/v2/models/mlp", "/v2/models/mlp/versions/1",
    f"/v2/models/{EMBEDDINGS}", f"/v2/models/{GENERATION}", "/v1", "/v1/models", "/", "/metrics",
])  # fmt: skip


@SETTINGS
@given(
    method=METHODS,
    root=ROUTE_ROOTS,
    segments=st.lists(SEGMENT, max_size=3),
    body=st.none() | st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()),
)
def test_every_route_and_method_is_an_answer_or_a_4xx(
    fuzzed: Fuzzed,
    client: httpx.Client,
    method: str,
    root: str,
    segments: list[str],
    body: bytes | None,
) -> None:
    path = "/".join([root.rstrip("/"), *(quote(s, safe="") for s in segments)]) or "/"
    if path.endswith("/policy") and method not in ("GET", "HEAD"):
        method = "GET"  # policy changes are the policy test's, which undoes them
    response = client.request(method, path, content=body)
    _check(fuzzed, response, repr((body or b"")[:200]))


# -- OpenAI -----------------------------------------------------------------------------

TEXTS = st.text(max_size=40)
TOKEN_IDS = st.lists(st.integers(-5, 300) | st.integers(-(2**70), 2**70), max_size=8)
OPENAI_MODELS = st.sampled_from([EMBEDDINGS, GENERATION, MLP]) | MODEL_NAMES


def _maybe(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Each of ``fields`` present or not, with a plausible value or any JSON value."""
    return st.fixed_dictionaries({}, optional={k: s | JSON_VALUES for k, s in fields.items()})


EMBEDDING_BODIES = _maybe(
    {
        "model": st.just(EMBEDDINGS) | OPENAI_MODELS,
        "input": TEXTS | st.lists(TEXTS, max_size=4) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3),
        "encoding_format": st.sampled_from(["float", "base64", "int8"]),
        "dimensions": st.integers(-2, 400),
        "user": TEXTS,
        "priority": st.sampled_from(["high", "normal", "low"]),
        "timeout_s": st.floats(-1, 10),
        "bogus": st.just(1),
    }
)


@SETTINGS
@given(document=EMBEDDING_BODIES, data=st.data())
def test_openai_embeddings_are_a_result_or_a_4xx(
    fuzzed: Fuzzed, client: httpx.Client, document: dict[str, Any], data: st.DataObject
) -> None:
    document = data.draw(st.sampled_from([document] * 6) | JSON_VALUES)
    body = data.draw(json_text(document))
    response = client.post("/v1/embeddings", content=body)
    _check(fuzzed, response, repr(body[:300]))
    if response.status_code == 200:
        assert response.json()["object"] == "list"


SAMPLING = {
    "model": st.just(GENERATION) | OPENAI_MODELS,
    "max_tokens": st.integers(-2, 6) | st.integers(2000, 2**70),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50),
    "seed": st.integers(-(2**70), 2**70),
    "stop": TEXTS | st.lists(TEXTS, max_size=6),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "stop_token_ids": TOKEN_IDS,
    "logprobs": st.booleans(),
    "priority": st.sampled_from(["high", "normal"]),
    "logit_bias": st.dictionaries(TEXTS, st.integers(-100, 100), max_size=2),
}
COMPLETION_BODIES = _maybe(
    {**SAMPLING, "prompt": TEXTS | st.lists(TEXTS, max_size=3) | TOKEN_IDS, "echo": st.booleans()}
)
MESSAGES = st.lists(
    _maybe(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
            "content": TEXTS
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS})),
            "name": TEXTS,
        }
    ),
    max_size=3,
)
CHAT_BODIES = _maybe(
    {**SAMPLING, "messages": MESSAGES, "max_completion_tokens": st.integers(-1, 6)}
)


@SETTINGS
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    completion=COMPLETION_BODIES,
    chat=CHAT_BODIES,
    data=st.data(),
)
def test_openai_completions_and_chat_are_a_result_or_a_4xx(
    fuzzed: Fuzzed,
    client: httpx.Client,
    route: str,
    completion: dict[str, Any],
    chat: dict[str, Any],
    data: st.DataObject,
) -> None:
    document: Any = chat if "chat" in route else completion
    document = data.draw(st.sampled_from([document] * 6) | JSON_VALUES)
    body = data.draw(json_text(document))
    response = client.post(route, content=body)
    _check(fuzzed, response, repr(body[:300]))


# -- the batch policy -------------------------------------------------------------------

POLICY_VALUES = {
    "max_batch_size": st.integers(-1, 128) | st.just("auto"),
    "max_delay_s": st.floats(-1, 0.01) | st.just("auto") | st.just("soon"),
    "preferred_batch_sizes": st.lists(st.integers(-1, 64), max_size=3),
    "max_batch_cost": st.floats(-1, 100),
    "max_queue_size": st.none() | st.integers(-1, 1000),
    "max_queue_time_s": st.none() | st.floats(-1, 1) | st.just("auto") | st.just("soon"),
    "timeout_s": st.none() | st.floats(-1, 10),
    "default_class": st.sampled_from(["normal", "high", ""]),
    "fill_from_lower": st.booleans(),
    "oom_recovery_s": st.floats(-1, 60),
    "max_batch_tokens": st.none() | st.integers(-1, 5000),
    "length_buckets": st.none() | st.just("auto") | st.lists(st.integers(-1, 64), max_size=3),
    "batch_timeout_s": st.none() | st.floats(-1, 120),
    "slo_s": st.none() | st.floats(-1, 1),
    "preempt": st.booleans() | st.just("yes"),
}
assert set(POLICY_VALUES) == set(POLICY_FIELDS)
POLICY_BODIES = _maybe({**POLICY_VALUES, "classes": st.just([]), "warp": st.just(9)})


@SETTINGS
@given(
    model=st.sampled_from([MLP, EMBEDDINGS, GENERATION]) | MODEL_NAMES,
    document=POLICY_BODIES,
    data=st.data(),
)
def test_policy_changes_are_taken_or_refused_and_undone(
    fuzzed: Fuzzed, client: httpx.Client, model: str, document: Any, data: st.DataObject
) -> None:
    url = f"/v2/models/{quote(model, safe='')}/policy"
    before = client.get(url)
    _check(fuzzed, before, "")
    document = data.draw(st.sampled_from([document] * 6) | JSON_VALUES)
    body = data.draw(json_text(document))
    response = client.post(url, content=body)
    _check(fuzzed, response, repr(body[:300]))
    if response.status_code == 200:  # undo it: later cases meet the built-in policy
        assert client.post(url, json=before.json()).json() == before.json()


# -- /metrics ---------------------------------------------------------------------------


@SETTINGS
@given(
    accept=st.none()
    | st.sampled_from(["text/plain", "application/openmetrics-text; version=1.0.0", "*/*"])
    | HEADER_TEXT,
    encoding=st.none()
    | st.sampled_from(["gzip", "deflate", "identity", "br, gzip;q=0"])
    | HEADER_TEXT,
    query=st.lists(
        st.sampled_from(["carpool_requests_total", "carpool_batch_size", "nope"]) | TEXTS,
        max_size=3,
    ),
)
def test_metrics_always_parse(
    fuzzed: Fuzzed,
    client: httpx.Client,
    accept: str | None,
    encoding: str | None,
    query: list[str],
) -> None:
    headers = {k: v for k, v in {"accept": accept, "accept-encoding": encoding}.items() if v}
    response = client.get("/metrics", params=[("name[]", q) for q in query], headers=headers)
    _check(fuzzed, response, repr(headers))
    if response.status_code != 200:
        return
    if response.headers.get("content-encoding", "identity") not in ("identity", "gzip", "deflate"):
        return  # a coding httpx does not undo here
    if response.headers.get("content-type", "").startswith("application/openmetrics-text"):
        list(openmetrics_families(response.text))
    else:
        list(text_string_to_metric_families(response.text))


def test_memory_grew_at_most_50_mib_over_the_module(fuzzed: Fuzzed) -> None:
    check_memory(fuzzed)
