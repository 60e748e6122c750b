"""Ragged KServe inputs (Triton's allow_ragged_batch): requests of different lengths share
a batch and reach the model packed, never padded to each other's length."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import tritonclient.http as httpclient

CONFIG = """
models:
  - name: ragged
    kind: python
    source: configmodels:ragged_sum
    inputs:
      - {name: TOKENS, datatype: INT64, shape: [-1], ragged: true}
      - {name: SCALE, datatype: INT64, shape: [1]}
    outputs:
      - {name: SUM, datatype: INT64, shape: []}
      - {name: DOUBLED, datatype: INT64, shape: [-1]}
      - {name: LONGEST, datatype: INT32, shape: []}
    max_batch_size: 32
    max_delay_s: 0.2
"""


def _infer(url: str, tokens: np.ndarray, scale: int) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(url)
    try:
        inputs = [
            httpclient.InferInput("TOKENS", list(tokens.shape), "INT64"),
            httpclient.InferInput("SCALE", [tokens.shape[0], 1], "INT64"),
        ]
        inputs[0].set_data_from_numpy(tokens)
        inputs[1].set_data_from_numpy(np.full((tokens.shape[0], 1), scale, dtype=np.int64))
        return client.infer("ragged", inputs)
    finally:
        client.close()


def test_requests_of_different_lengths_share_a_packed_batch(start_server):
    served = start_server(CONFIG)
    rows = [np.arange(1, n + 1, dtype=np.int64)[None] for n in (1, 3, 7, 2, 5, 4)]
    rows.append(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64))  # one request, two rows
    with ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda r: _infer(served.http_url, r[1], r[0] + 1), enumerate(rows)))
    for scale, (tokens, result) in enumerate(zip(rows, results, strict=True), start=1):
        np.testing.assert_array_equal(result.as_numpy("SUM"), tokens.sum(axis=1) * scale)
        np.testing.assert_array_equal(result.as_numpy("DOUBLED"), tokens * 2)
    longest = [int(r.as_numpy("LONGEST")[0]) for r in results]
    assert max(longest) == 7  # the 7-token request rode with at least one other
    assert sum(x == 7 for x in longest) > 1
    stats = httpx.get(f"http://{served.http_url}/v2/models/ragged/stats").json()
    model_stats = stats["model_stats"][0]
    assert model_stats["execution_count"] < model_stats["inference_count"]
    config = httpx.get(f"http://{served.http_url}/v2/models/ragged/config").json()
    assert config["input"][0]["allow_ragged_batch"] is True
