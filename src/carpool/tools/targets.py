"""What ``carpool bench`` loads: a served model over HTTP, or a batched function in-process.

Every target builds its payloads once, in :meth:`open`, from a seeded RNG, and rotates
through them by request index; an HTTP target keeps them as whole encoded requests::

    POST /v2/models/mlp/infer HTTP/1.1 CRLF Host: .. CRLF Content-Length: 1090 CRLF CRLF {json}..
    ^ built once per payload; sending it is one transport.write

Protocols: ``kserve-json`` / ``kserve-binary`` (KServe v2 with Triton's binary tensor
extension; input names, datatypes and shapes come from the model's metadata),
``openai-embeddings`` (``/v1/embeddings``, texts rotated), ``openai-completions``
(``/v1/completions``; with streaming, time to first token and inter-token gaps from the
Server-Sent Events), and ``module:attr`` (a carpool BatchedFunction or Batcher, or a plain
batched callable wrapped in :func:`carpool.batched`).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import orjson

from carpool.core.batcher import Batcher
from carpool.core.decorator import BatchedFunction
from carpool.core.telemetry import TelemetrySnapshot
from carpool.errors import ConfigError
from carpool.tools.httpclient import (
    ChunkSink,
    HttpClient,
    SseParser,
    encode_request,
    host_header,
    split_url,
)
from carpool.tools.loadgen import RequestRecord, Target
from carpool.tools.modelref import (
    MODEL_FORMS,
    ConfiguredModel,
    Form,
    ImportedModel,
    ModelRef,
    forms_text,
    resolve,
)

if TYPE_CHECKING:
    from carpool.server.repository import TensorSpec

DEFAULT_TEXT = "A container truck carrying one strawberry wastes the road; share the ride."


def read_texts(path: str | Path | None) -> tuple[str, ...]:
    """The non-empty lines of the file ``path`` (None: :data:`DEFAULT_TEXT` alone).

    Raises:
        ConfigError: on ``texts`` for a file that cannot be read or holds no text.
    """
    if path is None:
        return (DEFAULT_TEXT,)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConfigError("texts", str(path), f"a readable file ({error.strerror})") from None
    texts = tuple(line for line in lines if line.strip())
    if not texts:
        raise ConfigError("texts", str(path), "a file with at least one non-empty line")
    return texts


_DTYPES = {
    "BOOL": "?", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
}  # fmt: skip


class Wire(enum.Enum):
    KSERVE_JSON = "kserve-json"
    KSERVE_BINARY = "kserve-binary"
    OPENAI_EMBEDDINGS = "openai-embeddings"
    OPENAI_COMPLETIONS = "openai-completions"


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """How to build a target; ``input_shape`` includes the batch (items) dimension first."""

    target: str | None  # http://host:port[/prefix] or module:attr; None with config
    wire: Wire = Wire.KSERVE_BINARY
    model: str | None = None  # the served name, or with config the entry's
    config: str | None = None  # a serve config whose model ``model`` runs in-process
    input_shape: tuple[int, ...] | None = None
    datatype: str | None = None  # a KServe datatype (FP32, INT64, ...)
    texts: tuple[str, ...] = (DEFAULT_TEXT,)
    max_tokens: int = 16
    is_streaming: bool = True
    seed: int = 0
    num_payloads: int = 16  # distinct payloads rotated through
    max_connections: int = 1024

    def __post_init__(self) -> None:
        """Flags checked before any request (a bad flag exits 2 without connecting)."""
        if self.datatype is not None and self.datatype not in (*_DTYPES, "BYTES"):
            raise ConfigError("dtype", self.datatype, f"one of {[*_DTYPES, 'BYTES']}")
        if self.max_connections < 1:
            raise ConfigError("max-connections", self.max_connections, "an integer >= 1")

    @property
    def is_http(self) -> bool:
        return self.target is not None and self.target.startswith(("http://", "https://"))

    @property
    def label(self) -> str:
        """The target as the command line gave it."""
        if self.target is not None:
            return self.target
        return f"--config {self.config} --model {self.model}"


# What ``carpool bench`` runs in-process (see carpool.tools.modelref).
BENCH_FORMS = (*MODEL_FORMS, Form.BATCHED, Form.BATCHER)


def resolve_target(spec: TargetSpec) -> ModelRef:
    """The in-process model ``spec`` names: ``module:attr`` in any of :data:`BENCH_FORMS`,
    or ``config`` and ``model``.

    Raises:
        ConfigError: naming what fits no form, listing the forms (and a server URL).
    """
    if spec.target is None and spec.config is None:
        raise ConfigError(
            "target", None, f"http://host:port (a server), or {forms_text(BENCH_FORMS)}"
        )
    if spec.is_http and spec.config is not None:
        expected = "no --config with a server URL: --config runs the model in this process"
        raise ConfigError("config", spec.config, expected)
    model = spec.model if spec.config is not None else None  # else --model is a served name
    return resolve(spec.target, config=spec.config, model=model, accepts=BENCH_FORMS)


def make_target(spec: TargetSpec) -> Target:
    """The target ``spec`` describes (not yet opened).

    Raises:
        ConfigError: a missing model name, a model named in no form (see
            :func:`resolve_target`), a bad shape.
    """
    if not spec.is_http or spec.config is not None:
        return InProcessTarget(spec)
    if spec.model is None:
        raise ConfigError("model", None, f"a model name (--model) for {spec.wire.value}")
    if spec.wire in (Wire.KSERVE_JSON, Wire.KSERVE_BINARY):
        return KServeTarget(spec)
    if spec.wire is Wire.OPENAI_EMBEDDINGS:
        return EmbeddingsTarget(spec)
    return CompletionsTarget(spec)


def random_tensor(
    shape: tuple[int, ...], datatype: str, rng: np.random.Generator
) -> npt.NDArray[Any]:
    """Seeded data of a KServe ``datatype``: normal floats, small integers, short words."""
    if datatype == "BYTES":
        words = np.empty(shape, dtype=object)
        words.ravel()[:] = [f"word{w}".encode() for w in rng.integers(0, 1000, words.size)]
        return words
    if datatype not in _DTYPES:
        raise ConfigError("dtype", datatype, f"one of {[*_DTYPES, 'BYTES']}")
    dtype = np.dtype(_DTYPES[datatype])
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


def sample_inputs(
    specs: Sequence[TensorSpec],
    rng: np.random.Generator,
    *,
    num_items: int | None = None,
    shape: tuple[int, ...] | None = None,
) -> dict[str, npt.NDArray[Any]]:
    """Seeded data for a served model's declared inputs ``specs``: each of ``shape`` (else
    its declared one, a variable dim as 16, as for a KServe target), with ``num_items``
    first when given; BF16 as the FP32 values a server decodes it to."""
    out = {}
    for spec in specs:
        dims = shape if shape is not None else tuple(16 if d < 0 else d for d in spec.shape)
        dims = dims if num_items is None else (num_items, *dims)
        datatype = "FP32" if spec.datatype == "BF16" else spec.datatype
        out[spec.name] = random_tensor(dims, datatype, rng)
    return out


class _HttpTarget:
    """Shared by the HTTP targets: the client and the rotation of pre-encoded requests."""

    def __init__(self, spec: TargetSpec) -> None:
        host, port, self._prefix = split_url(spec.label)
        self._spec = spec
        self._host_header = host_header(host, port)
        self.client = HttpClient(host, port, max_connections=spec.max_connections)
        self.requests: list[bytes] = []
        self.num_items = 1
        self.description = f"{spec.wire.value} {spec.model} at {spec.target}"

    def _post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        return encode_request("POST", self._host_header, self._prefix + path, body, headers)

    async def _fetch_json(self, path: str) -> Any:
        response = await self.client.get(self._prefix + path)
        if response.status != 200:
            raise ConfigError(
                "target", self._spec.label + path, f"a 200 answer, got HTTP {response.status}"
            )
        return orjson.loads(response.body)

    async def _check_openai_model(self) -> None:
        """The model is one the server lists at ``/v1/models``: otherwise every request
        of the run would be a 404, counted and the run ended as if it had measured."""
        listed = await self._fetch_json("/v1/models")
        names = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
        if self._spec.model not in names:
            raise ConfigError("model", self._spec.model, f"one the server lists: {names}")

    async def call(self, record: RequestRecord) -> None:
        await self._send(record)

    async def _send(self, record: RequestRecord, sink: ChunkSink | None = None) -> bytes:
        request = self.requests[record.index % len(self.requests)]
        response = await self.client.request(request, sink)
        record.sent_s = response.sent_s
        record.status = response.status
        record.num_items = self.num_items
        if response.status != 200:
            record.error = f"HTTP {response.status}"
        return response.body

    async def close(self) -> None:
        await self.client.close()


class KServeTarget(_HttpTarget):
    """``POST /v2/models/{model}/infer`` with JSON or binary tensors."""

    async def open(self) -> None:
        spec = self._spec
        metadata = await self._fetch_json(f"/v2/models/{spec.model}")
        inputs = metadata.get("inputs") or []
        if not inputs:
            raise ConfigError("model", spec.model, "a model whose metadata lists its inputs")
        rng = np.random.default_rng(spec.seed)
        shapes = [self._shape(entry["shape"]) for entry in inputs]
        self.num_items = shapes[0][0] if shapes[0] else 1
        for _ in range(spec.num_payloads):
            tensors = [
                (entry["name"], spec.datatype or entry["datatype"], shape)
                for entry, shape in zip(inputs, shapes, strict=True)
            ]
            body, headers = self._encode(tensors, rng)
            self.requests.append(self._post(f"/v2/models/{spec.model}/infer", body, headers))

    def _shape(self, declared: list[int]) -> tuple[int, ...]:
        if self._spec.input_shape is not None:
            return self._spec.input_shape
        # One item per request; a variable dimension past the batch one gets 16.
        return (1, *(16 if d < 0 else d for d in declared[1:]))

    def _encode(
        self, tensors: list[tuple[str, str, tuple[int, ...]]], rng: np.random.Generator
    ) -> tuple[bytes, dict[str, str]]:
        is_binary = self._spec.wire is Wire.KSERVE_BINARY
        entries: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        for name, datatype, shape in tensors:
            array = random_tensor(shape, datatype, rng)
            entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(shape)}
            if is_binary:
                chunk = _binary(array, datatype)
                entry["parameters"] = {"binary_data_size": len(chunk)}
                chunks.append(chunk)
            elif datatype == "BYTES":
                entry["data"] = [v.decode() for v in array.ravel().tolist()]
            else:
                entry["data"] = array.ravel().tolist()
            entries.append(entry)
        header = orjson.dumps({"inputs": entries, "parameters": {"binary_data_output": is_binary}})
        if not is_binary:
            return header, {"Content-Type": "application/json"}
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        }
        return header + b"".join(chunks), headers


def _binary(array: npt.NDArray[Any], datatype: str) -> bytes:
    if datatype != "BYTES":
        return array.astype(_DTYPES[datatype], copy=False).tobytes()
    parts: list[bytes] = []
    for element in array.ravel().tolist():
        parts += [len(element).to_bytes(4, "little"), element]
    return b"".join(parts)


class EmbeddingsTarget(_HttpTarget):
    """``POST /v1/embeddings``, one text per request, rotating through ``texts``."""

    async def open(self) -> None:
        spec = self._spec
        await self._check_openai_model()
        headers = {"Content-Type": "application/json"}
        for text in spec.texts:
            body = orjson.dumps({"model": spec.model, "input": text})
            self.requests.append(self._post("/v1/embeddings", body, headers))


class CompletionsTarget(_HttpTarget):
    """``POST /v1/completions``; streamed answers give TTFT and inter-token latencies."""

    async def open(self) -> None:
        spec = self._spec
        await self._check_openai_model()
        headers = {"Content-Type": "application/json"}
        for text in spec.texts:
            document: dict[str, Any] = {
                "model": spec.model,
                "prompt": text,
                "max_tokens": spec.max_tokens,
                "stream": spec.is_streaming,
            }
            self.requests.append(self._post("/v1/completions", orjson.dumps(document), headers))

    async def call(self, record: RequestRecord) -> None:
        if not self._spec.is_streaming:
            body = await self._send(record)
            if record.error is None:
                record.num_tokens = _completion_tokens(body)
            return
        stream = TokenStream()
        await self._send(record, stream.feed)
        if record.error is None:
            stream.fill(record)


class TokenStream:
    """Token arrival times from a completions SSE stream (one event, one token)."""

    __slots__ = ("_parser", "times_s")

    def __init__(self) -> None:
        self._parser = SseParser()
        self.times_s: list[float] = []

    def feed(self, chunk: bytes) -> None:
        now = time.monotonic()
        for data in self._parser.feed(chunk):
            # [DONE] ends the stream; a usage-only chunk (choices == []) carries no token.
            if data != b"[DONE]" and b'"choices":[]' not in data:
                self.times_s.append(now)

    def fill(self, record: RequestRecord) -> None:
        times = self.times_s
        record.num_tokens = len(times)
        if times:
            record.first_token_s = times[0]
            record.itl_s = [b - a for a, b in itertools.pairwise(times)]


def _completion_tokens(body: bytes) -> int:
    try:
        doc = orjson.loads(body)
        return int(doc["usage"]["completion_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return 0


class InProcessTarget:
    """A model run in-process with ``input_shape[0]`` items per request (``submit_many``):
    a carpool BatchedFunction or Batcher as it is, a plain batched callable, a factory or an
    ``nn.Module`` behind a Batcher with the default policy, or a serve config's model
    behind the batcher ``carpool serve`` builds for it (its policy, devices, collator),
    sent ``{input name: array}`` of its declared inputs."""

    def __init__(self, spec: TargetSpec) -> None:
        self._spec = spec
        ref = resolve_target(spec)
        self._inputs: tuple[TensorSpec, ...] | None = None
        if isinstance(ref, ConfiguredModel):
            served = ref.served("bench")
            self._batcher, self._inputs = served.require_batcher(), served.inputs
        else:
            self._batcher = _batcher_of(ref)
        self.description = f"in-process {ref.label}"
        self._payloads: list[Any] = []
        self._num_items = 1

    async def open(self) -> None:
        spec = self._spec
        rng = np.random.default_rng(spec.seed)
        if self._inputs is not None:  # a config's model: its declared inputs
            shape = spec.input_shape or (1,)
            self._num_items, dims = shape[0], (shape[1:] or None)
            self._payloads = [
                sample_inputs(self._inputs, rng, num_items=self._num_items, shape=dims)
                for _ in range(spec.num_payloads)
            ]
        else:
            if spec.input_shape is None or not spec.input_shape:
                raise ConfigError("input_shape", None, "--input-shape for a module:attr target")
            datatype = spec.datatype or "FP32"
            self._payloads = [
                random_tensor(spec.input_shape, datatype, rng) for _ in range(spec.num_payloads)
            ]
            self._num_items = spec.input_shape[0]
        await self._batcher.start()

    async def call(self, record: RequestRecord) -> None:
        record.sent_s = time.monotonic()
        await self._batcher.submit_many(self._payloads[record.index % len(self._payloads)])
        record.num_items = self._num_items

    async def close(self) -> None:
        await self._batcher.stop(drain=True)

    def snapshot(self) -> TelemetrySnapshot:
        return self._batcher.snapshot()


def _batcher_of(ref: ImportedModel) -> Batcher:
    """The batcher an imported model runs behind: its own, or one with the default policy."""
    if ref.form is Form.BATCHED:
        function: BatchedFunction = ref.obj
        return function.batcher
    if ref.form is Form.BATCHER:
        batcher: Batcher = ref.obj
        return batcher
    name = ref.source.rpartition(":")[2]
    if ref.form is Form.CALLABLE:
        return Batcher(ref.obj, name=name)
    return Batcher(fn_factory=ref.batched_callable, name=name)  # a factory or an nn.Module
