"""``POST /v2/models/{m}/policy`` on a real server while it serves, reviewed.

A Triton user who changes a model's configuration expects what was already accepted to be
answered, and a bad configuration to be refused whole. Here: requests keep flowing (httpx,
JSON tensors, some with a Triton priority level) while valid, invalid and simultaneous
POSTs change the policy; every accepted request gets its own answer once, every bad POST
is a 400 naming the field and changes nothing, simultaneous POSTs leave one of them in
force, and /config, /metrics and /stats agree afterwards. A gated model then shows that
requests queued before a lowered ``max_batch_size`` run in batches of the new size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServedProcess, start_served_process, wait_until

WAIT_LIMIT_S = 20.0  # a net against a hung test, never a timing assertion
NUM_WORKERS = 16
REQUESTS_PER_WORKER = 20

MODELS = """\
import os
import time

import numpy as np


def sleepy_double(inputs):
    time.sleep(0.002)
    return {"OUTPUT0": inputs["INPUT0"] * 2}


def recorded(inputs):
    # Appends each batch's size to $POLICY_TEST_SIZES, then blocks while $POLICY_TEST_GATE
    # exists (at most 30 s).
    x = inputs["X"]
    with open(os.environ["POLICY_TEST_SIZES"], "a", encoding="utf-8") as sizes:
        sizes.write(f"{len(x)}\\n")
    limit = time.monotonic() + 30.0
    while os.path.exists(os.environ["POLICY_TEST_GATE"]) and time.monotonic() < limit:
        time.sleep(0.005)
    return {"Y": x}
"""

CONFIG = """\
models:
  - name: doubler
    kind: python
    source: policymodels:sleepy_double
    inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
    max_batch_size: 16
    max_delay_s: 0.001
  - name: recorded
    kind: python
    source: policymodels:recorded
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 8
    max_delay_s: 0.001
"""


class Served:
    def __init__(self, process: ServedProcess, sizes: Path, gate: Path) -> None:
        self.process = process
        self.url = f"http://{process.http_url}"
        self.sizes = sizes
        self.gate = gate

    def batch_sizes(self) -> list[int]:
        return [int(v) for v in self.sizes.read_text().split()] if self.sizes.exists() else []


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("policy-review")
    (folder / "policymodels.py").write_text(MODELS, encoding="utf-8")
    sizes, gate = folder / "sizes.txt", folder / "gate"
    env = {"POLICY_TEST_SIZES": str(sizes), "POLICY_TEST_GATE": str(gate)}
    process = start_served_process(CONFIG, folder, env=env, args=["--allow-policy-updates"])
    try:
        yield Served(process, sizes, gate)
    finally:
        gate.unlink(missing_ok=True)
        assert process.stop() == 0, process.output()


def _body(value: float, priority: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
             "data": [value, value + 0.25, value + 0.5, value + 0.75]}
        ]
    }  # fmt: skip
    if priority is not None:
        body["parameters"] = {"priority": priority}
    return body


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def _worker(
    client: httpx.AsyncClient, url: str, worker: int, outcome: dict[str, int]
) -> None:
    for i in range(REQUESTS_PER_WORKER):
        value = float(worker * 1000 + i)
        priority = (None, 0, 1, 3)[i % 4]
        reply = await client.post(f"{url}/infer", json=_body(value, priority))
        if reply.status_code == 429:  # a lowered max_queue_size: refused, not accepted
            outcome["refused"] += 1
            continue
        assert reply.status_code == 200, reply.text
        (output,) = reply.json()["outputs"]
        assert output["data"] == [2 * value, 2 * value + 0.5, 2 * value + 1.0, 2 * value + 1.5]
        outcome["answered"] += 1


BAD_POSTS: list[tuple[dict[str, Any] | bytes, str]] = [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_batch_size": 4.5}, "max_batch_size"),
    ({"max_delay_s": -0.001}, "max_delay_s"),
    ({"max_delay_s": "0.01"}, "max_delay_s"),
    ({"preferred_batch_sizes": [64]}, "preferred_batch_sizes"),
    ({"max_queue_size": 0}, "max_queue_size"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"default_class": "vip"}, "default_class"),
    ({"fill_from_lower": "no"}, "fill_from_lower"),
    ({"max_batch_tokens": 64}, "max_batch_tokens"),  # a dict model measures no tokens
    ({"length_buckets": [16, 8]}, "length_buckets"),
    ({"max_batch_size": 4, "warp": 9}, "warp"),
    ({"classes": []}, "classes"),
    (b"[1, 2]", "JSON object"),
    (b"{nope", "JSON object"),
]


async def test_policy_changes_under_load_lose_nothing_and_bad_posts_change_nothing(
    served: Served,
) -> None:
    url = f"{served.url}/v2/models/doubler"
    limits = httpx.Limits(max_connections=NUM_WORKERS + 8)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        metrics_before = (await client.get(f"{served.url}/metrics")).text
        stats_before = (await client.get(f"{url}/stats")).json()["model_stats"][0]
        outcome = {"answered": 0, "refused": 0}
        workers = [
            asyncio.create_task(_worker(client, url, w, outcome)) for w in range(NUM_WORKERS)
        ]

        async def post(changes: dict[str, Any] | bytes) -> httpx.Response:
            if isinstance(changes, bytes):
                return await client.post(f"{url}/policy", content=changes)
            return await client.post(f"{url}/policy", json=changes)

        good = [
            {"max_batch_size": 2, "max_delay_s": 0.0},
            {"max_batch_size": 8, "preferred_batch_sizes": [4, 8], "max_delay_s": 0.002},
            {"max_queue_size": 3},
            {"default_class": "background", "fill_from_lower": False},
            {"max_batch_size": 1, "preferred_batch_sizes": []},
            {"max_queue_size": None, "timeout_s": 5.0, "default_class": "normal"},
            {"max_batch_size": 16, "max_delay_s": 0.001, "fill_from_lower": True},
        ]
        for changes in good:
            reply = await post(changes)
            assert reply.status_code == 200, reply.text
            for name, value in changes.items():
                assert reply.json()[name] == value
            for bad, field in BAD_POSTS:
                before = (await client.get(f"{url}/policy")).json()
                reply = await post(bad)
                assert reply.status_code == 400, (bad, reply.text)
                assert field in reply.json()["error"], (bad, reply.json())
                assert (await client.get(f"{url}/policy")).json() == before, bad
            await asyncio.sleep(0.02)  # let some load run under this policy

        # Simultaneous POSTs, each a consistent pair: one pair wins whole.
        pairs = [{"max_batch_size": n, "preferred_batch_sizes": [n]} for n in (2, 3, 5, 7, 9)]
        replies = await asyncio.gather(*(post(p) for p in pairs * 4))
        assert all(r.status_code == 200 for r in replies)
        final = (await client.get(f"{url}/policy")).json()
        assert final["preferred_batch_sizes"] == [final["max_batch_size"]]
        for reply, pair in zip(replies, pairs * 4, strict=True):  # each answers its own
            assert reply.json()["preferred_batch_sizes"] == pair["preferred_batch_sizes"]
            assert reply.json()["max_batch_size"] == pair["max_batch_size"]
        assert final in [r.json() for r in replies]

        await asyncio.wait_for(asyncio.gather(*workers), WAIT_LIMIT_S)
        sent = NUM_WORKERS * REQUESTS_PER_WORKER
        assert outcome["answered"] + outcome["refused"] == sent
        assert outcome["answered"] > sent // 2

        config = (await client.get(f"{url}/config")).json()
        assert config["max_batch_size"] == final["max_batch_size"]
        assert config["dynamic_batching"]["preferred_batch_size"] == final["preferred_batch_sizes"]
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == round(
            final["max_delay_s"] * 1e6
        )
        stats = (await client.get(f"{url}/stats")).json()["model_stats"][0]
        # One row per request: each accepted request counted once, nothing twice.
        assert stats["inference_count"] - stats_before["inference_count"] == outcome["answered"]
        metrics = (await client.get(f"{served.url}/metrics")).text

    def delta(name: str, **labels: str) -> float:
        return _metric(metrics, name, model="doubler", **labels) - _metric(
            metrics_before, name, model="doubler", **labels
        )

    assert delta("carpool_requests_total") == sent - outcome["refused"]
    assert delta("carpool_requests_completed_total") == outcome["answered"]
    assert delta("carpool_rejections_total", reason="queue_full") == outcome["refused"]
    assert _metric(metrics, "carpool_pending_requests", model="doubler") == 0
    # Requests without a level went to "background" while it was the default class.
    assert delta("carpool_requests_total", **{"class": "background"}) > 0


def _pending(url: str, model: str) -> float:
    return _metric(httpx.get(f"{url}/metrics").text, "carpool_pending_requests", model=model)


async def test_requests_queued_before_max_batch_size_is_lowered_run_in_batches_of_the_new_size(
    served: Served,
) -> None:
    url = f"{served.url}/v2/models/recorded"
    served.gate.touch()
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:

            async def infer(value: int) -> int:
                body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64",
                                    "data": [value]}]}  # fmt: skip
                reply = await client.post(f"{url}/infer", json=body)
                assert reply.status_code == 200, reply.text
                return int(reply.json()["outputs"][0]["data"][0])

            first = asyncio.create_task(infer(0))
            await asyncio.to_thread(wait_until, lambda: served.batch_sizes() == [1], "batch 1")
            rest = [asyncio.create_task(infer(v)) for v in range(1, 12)]
            await asyncio.to_thread(
                wait_until, lambda: _pending(served.url, "recorded") == 11, "11 queued"
            )
            reply = await client.post(f"{url}/policy", json={"max_batch_size": 3})
            assert reply.status_code == 200 and reply.json()["max_batch_size"] == 3
            served.gate.unlink()
            results = await asyncio.wait_for(asyncio.gather(first, *rest), WAIT_LIMIT_S)
            assert results == list(range(12))
            assert served.batch_sizes() == [1, 3, 3, 3, 2]
            stats = (await client.get(f"{url}/stats")).json()["model_stats"][0]
            assert stats["inference_count"] == 12
            by_size = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
            assert by_size == {1: 1, 3: 3, 2: 1}
    finally:
        served.gate.unlink(missing_ok=True)
