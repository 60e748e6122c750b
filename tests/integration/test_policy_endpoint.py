"""``GET|POST /v2/models/{m}/policy`` on a real server, and the tuner's server runner."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from carpool.tools.tune_runners import LoadSpec, ServerRunner
from carpool.tools.tune_trial import MeasureSettings, TrialConfig, measure_trial

from .conftest import StartServer

CONFIG = """\
models:
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
    max_batch_size: 16
    max_delay_s: 0.001
"""


async def test_policy_changes_at_run_time_and_bad_values_are_400(
    start_server: StartServer,
) -> None:
    served = start_server(CONFIG, args=["--allow-policy-updates"])
    url = f"http://{served.http_url}/v2/models/doubler"
    async with httpx.AsyncClient() as client:
        current = (await client.get(f"{url}/policy")).json()
        assert (current["max_batch_size"], current["max_delay_s"]) == (16, 0.001)

        reply = await client.post(f"{url}/policy", json={"max_batch_size": 4, "max_delay_s": 0})
        assert reply.status_code == 200
        assert reply.json()["max_batch_size"] == 4 and reply.json()["max_delay_s"] == 0
        config = (await client.get(f"{url}/config")).json()
        assert config["max_batch_size"] == 4

        reply = await client.post(f"{url}/policy", json={"max_batch_size": 0})
        assert reply.status_code == 400
        assert "max_batch_size" in reply.json()["error"]
        reply = await client.post(f"{url}/policy", json={"preferred_batch_sizes": [8]})
        assert reply.status_code == 400 and "preferred_batch_sizes" in reply.json()["error"]
        assert current["preempt"] is False
        reply = await client.post(f"{url}/policy", json={"preempt": True})
        assert reply.status_code == 200 and reply.json()["preempt"] is True
        reply = await client.post(f"{url}/policy", json={"preempt": "yes"})
        assert reply.status_code == 400 and "preempt" in reply.json()["error"]
        reply = await client.post(f"{url}/policy", json={"warp": 9})
        assert reply.status_code == 400 and "unknown field" in reply.json()["error"]
        reply = await client.post(f"{url}/policy", content=b"[1, 2]")
        assert reply.status_code == 400
        reply = await client.post(f"{url}/policy", content=b"{nope")
        assert reply.status_code == 400
        assert (await client.get(f"{url}/policy")).json()["max_batch_size"] == 4


@pytest.mark.parametrize("concurrency", [4, 1])
async def test_server_runner_measures_a_trial_through_the_endpoint(
    start_server: StartServer, concurrency: int
) -> None:
    """At concurrency 1 a trial never ended: the stats request between windows waited for
    the one connection the load's client kept taking back."""
    served = start_server(CONFIG, args=["--allow-policy-updates"])
    runner = ServerRunner(f"http://{served.http_url}", "doubler", LoadSpec(concurrency=concurrency))
    try:
        metadata = await runner.connect()
        assert metadata["name"] == "doubler"
        settings = MeasureSettings(warmup_s=0.0, window_s=0.1, max_windows=2, num_stable_windows=1)
        config = TrialConfig((("max_batch_size", 2), ("max_delay_s", 0.0005), ("preempt", 1)))
        m = await asyncio.wait_for(measure_trial(runner, config, settings), 30.0)
        assert m.error is None and m.num_requests > 0 and m.num_errors == 0
        assert m.mean_batch_size is not None and m.mean_batch_size <= 2
        policy = await runner.policy()
        assert (policy["max_batch_size"], policy["preempt"]) == (2, True)
        refused = await measure_trial(runner, TrialConfig((("max_batch_size", 0),)), settings)
        assert refused.error is not None and "max_batch_size" in refused.error
    finally:
        await runner.close()
