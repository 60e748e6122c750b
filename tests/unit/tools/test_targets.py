"""Targets: what each protocol puts on the wire (decoded by the server's own KServe
decoder), what it reads back (SSE tokens), and the in-process ``module:attr`` target."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from carpool.errors import ConfigError
from carpool.server.kserve.rest_decode import decode_infer_request
from carpool.tools.loadgen import RequestRecord
from carpool.tools.targets import (
    CompletionsTarget,
    EmbeddingsTarget,
    InProcessTarget,
    KServeTarget,
    TargetSpec,
    TokenStream,
    Wire,
    make_target,
    random_tensor,
)

Handler = Callable[[str, dict[str, str], bytes], list[bytes]]
METADATA = {
    "name": "mlp",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 256]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}],
}


@asynccontextmanager
async def tiny_server(
    handler: Handler,
) -> AsyncIterator[tuple[str, list[tuple[str, dict[str, str], bytes]]]]:
    """A keep-alive loopback server; yields its URL and the requests it received, but
    ``/v1/models``, which it answers itself listing model ``m`` (OPENAI_MODELS)."""
    seen: list[tuple[str, dict[str, str], bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = dict(line.split(": ", 1) for line in lines[1:] if line)
                body = await reader.readexactly(int(headers.get("Content-Length", "0")))
                if path == "/v1/models":
                    answer = ok(orjson.dumps(OPENAI_MODELS))
                else:
                    seen.append((path, headers, body))
                    answer = handler(path, headers, body)
                for part in answer:
                    writer.write(part)
                    await writer.drain()
        finally:
            writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}", seen
    finally:
        listener.close()
        await listener.wait_closed()


OPENAI_MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}


def ok(body: bytes, status: str = "200 OK") -> list[bytes]:
    return [f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body]


def kserve(path: str, headers: dict[str, str], body: bytes) -> list[bytes]:
    if path == "/v2/models/mlp":
        return ok(orjson.dumps(METADATA))
    if path == "/v2/models/mlp/infer":
        return ok(b'{"outputs": []}')
    return ok(b'{"error": "no such model"}', "404 Not Found")


async def _call(target: object, index: int = 0) -> RequestRecord:
    record = RequestRecord(index, 0.0)
    await target.call(record)  # type: ignore[attr-defined]
    return record


async def _five_concurrent_calls(target: InProcessTarget) -> tuple[list[RequestRecord], Any]:
    """Five calls at once on an in-process target, opened and closed around them, and
    its batch snapshot."""
    await target.open()
    try:
        records = await asyncio.gather(*(_call(target, i) for i in range(5)))
        return list(records), target.snapshot()
    finally:
        await target.close()


@pytest.mark.parametrize("wire", [Wire.KSERVE_BINARY, Wire.KSERVE_JSON])
async def test_kserve_bodies_decode_on_the_server_side(wire: Wire) -> None:
    async with tiny_server(kserve) as (url, seen):
        target = KServeTarget(TargetSpec(url, wire, model="mlp", input_shape=(2, 256)))
        await target.open()
        try:
            record = await _call(target)
        finally:
            await target.close()
    assert (record.status, record.error, record.num_items) == (200, None, 2)
    path, headers, body = seen[-1]
    assert path == "/v2/models/mlp/infer"
    length = headers.get("Inference-Header-Content-Length")
    request = decode_infer_request(body, int(length) if length else None)
    (tensor,) = request.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("INPUT0", "FP32", (2, 256))
    assert np.all(np.isfinite(tensor.array))
    assert (wire is Wire.KSERVE_BINARY) == (length is not None)


async def test_kserve_defaults_to_one_item_of_the_declared_shape_and_rotates_payloads() -> None:
    async with tiny_server(kserve) as (url, seen):
        target = KServeTarget(TargetSpec(url, model="mlp", num_payloads=3, seed=5))
        await target.open()
        try:
            for index in range(4):
                await _call(target, index)
        finally:
            await target.close()
    bodies = [body for path, _, body in seen if path.endswith("/infer")]
    assert bodies[0] == bodies[3] and bodies[0] != bodies[1]
    assert b'"shape":[1,256]' in bodies[0]


async def test_kserve_error_status_is_recorded() -> None:
    async with tiny_server(kserve) as (url, _):
        with pytest.raises(ConfigError, match="HTTP 404"):
            await KServeTarget(TargetSpec(url, model="nope")).open()
        target = KServeTarget(TargetSpec(url, model="mlp"))
        await target.open()
        target.requests = [target.requests[0].replace(b"/mlp/infer", b"/zz/infer")]
        try:
            record = await _call(target)
        finally:
            await target.close()
    assert (record.status, record.error) == (404, "HTTP 404")


async def test_embeddings_rotate_texts() -> None:
    async with tiny_server(lambda p, h, b: ok(b'{"data": []}')) as (url, seen):
        spec = TargetSpec(url, Wire.OPENAI_EMBEDDINGS, model="m", texts=("a", "b"))
        target = EmbeddingsTarget(spec)
        await target.open()
        try:
            for index in range(3):
                assert (await _call(target, index)).is_ok
        finally:
            await target.close()
    inputs = [orjson.loads(body)["input"] for _, _, body in seen]
    assert inputs == ["a", "b", "a"]
    assert seen[0][0] == "/v1/embeddings"


@pytest.mark.parametrize("wire", [Wire.OPENAI_EMBEDDINGS, Wire.OPENAI_COMPLETIONS])
async def test_an_openai_model_the_server_does_not_list_is_refused_before_the_run(
    wire: Wire,
) -> None:
    """Was: every request of the run a 404, and the run ended as if it had measured."""
    async with tiny_server(lambda p, h, b: ok(b"{}")) as (url, seen):
        target = CompletionsTarget if wire is Wire.OPENAI_COMPLETIONS else EmbeddingsTarget
        with pytest.raises(ConfigError, match=r"invalid model='nope'.*\['m'\]"):
            await target(TargetSpec(url, wire, model="nope", texts=("a",))).open()
    assert seen == []


def sse(path: str, headers: dict[str, str], body: bytes) -> list[bytes]:
    events = [b'{"choices":[{"text":"a"}]}', b'{"choices":[{"text":"b"}]}']
    events += [b'{"choices":[{"text":"c"}]}', b'{"choices":[],"usage":{}}', b"[DONE]"]
    parts = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ]
    for event in events:
        payload = b"data: " + event + b"\n\n"
        parts.append(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
    return [*parts, b"0\r\n\r\n"]


async def test_streamed_completions_give_ttft_and_inter_token_gaps() -> None:
    async with tiny_server(sse) as (url, seen):
        target = CompletionsTarget(
            TargetSpec(url, Wire.OPENAI_COMPLETIONS, model="m", max_tokens=3)
        )
        await target.open()
        try:
            record = await _call(target)
        finally:
            await target.close()
    assert record.is_ok and record.num_tokens == 3
    assert record.first_token_s is not None and record.itl_s is not None
    assert len(record.itl_s) == 2 and min(record.itl_s) >= 0
    sent = orjson.loads(seen[0][2])
    assert (sent["stream"], sent["max_tokens"], seen[0][0]) == (True, 3, "/v1/completions")


async def test_non_streamed_completions_read_usage() -> None:
    body = b'{"choices": [{"text": "abc"}], "usage": {"completion_tokens": 7}}'
    async with tiny_server(lambda p, h, b: ok(body)) as (url, _):
        spec = TargetSpec(url, Wire.OPENAI_COMPLETIONS, model="m", is_streaming=False)
        target = CompletionsTarget(spec)
        await target.open()
        try:
            record = await _call(target)
        finally:
            await target.close()
    assert (record.num_tokens, record.first_token_s) == (7, None)


def test_token_stream_skips_done_and_usage_only_chunks() -> None:
    stream = TokenStream()
    stream.feed(b'data: {"choices":[{"text":"x"}]}\n\ndata: {"choices":[]}\n\ndata: [DONE]\n\n')
    record = RequestRecord(0, 0.0)
    stream.fill(record)
    assert (record.num_tokens, record.itl_s) == (1, [])


# -- in-process -----------------------------------------------------------------------------

MODULE = """
import numpy as np
import carpool

def double(batch):
    return np.asarray(batch) * 2

@carpool.batched(max_batch_size=8, max_delay_s=0.0)
def halve(batch):
    return np.asarray(batch) / 2

def make_double(device):
    return double

def build_double():
    return double

def build_twice():
    import torch

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    return Twice()

def by_name(inputs):
    return {"y": inputs["x"] * 2}

not_callable = 3
"""


@pytest.fixture
def benchmodels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "benchtargetmodels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "benchtargetmodels"


@pytest.mark.parametrize("attr", ["double", "halve", "make_double", "build_double", "build_twice"])
async def test_in_process_target_runs_a_model_named_in_each_form(
    benchmodels: str, attr: str
) -> None:
    target = InProcessTarget(TargetSpec(f"{benchmodels}:{attr}", input_shape=(3, 4)))
    records, snapshot = await _five_concurrent_calls(target)
    assert all(r.is_ok and r.num_items == 3 for r in records)
    assert snapshot.batches.num_items == 15


def test_in_process_target_errors_name_the_problem(benchmodels: str) -> None:
    with pytest.raises(ConfigError, match="importable"):
        make_target(TargetSpec("no_such_module_xyz:f"))
    with pytest.raises(ConfigError, match="a name 'missing' defined in module"):
        make_target(TargetSpec(f"{benchmodels}:missing"))
    with pytest.raises(ConfigError, match="batched callable"):
        make_target(TargetSpec(f"{benchmodels}:not_callable"))
    with pytest.raises(ConfigError, match="module:attr"):
        make_target(TargetSpec("nocolon"))


SERVE_CONFIG = """
models:
  - name: doubled
    kind: python
    source: benchtargetmodels:by_name
    inputs: [{name: x, datatype: FP32, shape: [-1]}]
    outputs: [{name: y, datatype: FP32, shape: [-1]}]
    max_batch_size: 4
"""


@pytest.mark.parametrize(("input_shape", "rows"), [(None, 1), ((3, 5), 3)])
async def test_in_process_target_runs_a_serve_config_model_behind_its_batcher(
    benchmodels: str, tmp_path: Path, input_shape: tuple[int, ...] | None, rows: int
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_CONFIG)
    spec = TargetSpec(None, model="doubled", config=str(path), input_shape=input_shape)
    target = make_target(spec)
    assert isinstance(target, InProcessTarget)
    records, snapshot = await _five_concurrent_calls(target)
    assert all(r.is_ok and r.num_items == rows for r in records)
    assert snapshot.batches.num_items == 5 * rows
    assert target.description == f"in-process --config {path} --model doubled"


async def test_in_process_target_needs_an_input_shape(benchmodels: str) -> None:
    with pytest.raises(ConfigError, match="input-shape"):
        await InProcessTarget(TargetSpec(f"{benchmodels}:double")).open()


def test_http_targets_need_a_model_and_pick_by_protocol() -> None:
    with pytest.raises(ConfigError, match="--model"):
        make_target(TargetSpec("http://127.0.0.1:1"))
    kinds = {
        wire: type(make_target(TargetSpec("http://127.0.0.1:1", wire, model="m"))) for wire in Wire
    }
    assert kinds[Wire.KSERVE_JSON] is KServeTarget
    assert kinds[Wire.OPENAI_EMBEDDINGS] is EmbeddingsTarget
    assert kinds[Wire.OPENAI_COMPLETIONS] is CompletionsTarget


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "INT64", "UINT8", "BOOL", "BYTES"])
def test_random_tensor_is_seeded(datatype: str) -> None:
    a = random_tensor((2, 3), datatype, np.random.default_rng(1))
    b = random_tensor((2, 3), datatype, np.random.default_rng(1))
    assert a.shape == (2, 3) and a.tolist() == b.tolist()
    with pytest.raises(ConfigError, match="dtype"):
        random_tensor((1,), "COMPLEX", np.random.default_rng(1))
