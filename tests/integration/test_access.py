"""`carpool serve --api-key`, `--protect-metrics` and `--allow-policy-updates` on a real
server, with the clients users have: tritonclient (HTTP and gRPC, the key in their
``headers=``), openai (``api_key=``) and httpx. Issue 22, defect 6: anyone who reached the
port could set ``{"timeout_s": 1e-6}`` (every request then failed) or ``{"max_delay_s":
1e9}`` (requests left unanswered), and no option asked for a key.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from carpool.errors import ConfigError
from carpool.tools.tune_runners import LoadSpec, ServerRunner

from .conftest import DOUBLER_CONFIG, ServedProcess, StartServer, start_served_process

KEY = "k3y-0f-th1s-s3rv3r"
HTTP_HEADERS = {"Authorization": f"Bearer {KEY}"}  # tritonclient.http adds to its headers:
# it is given copies
GRPC_HEADERS = {"authorization": f"Bearer {KEY}"}  # gRPC metadata keys are lowercase


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    """The key given by flag, another in CARPOOL_API_KEY: the flag's is the one."""
    process = start_served_process(
        DOUBLER_CONFIG,
        tmp_path_factory.mktemp("access"),
        grpc=True,
        env={"CARPOOL_API_KEY": "the-environments-key"},
        args=["--api-key", KEY],
    )
    yield process
    assert process.stop() == 0, process.output()


def _inputs(module: Any, value: float) -> list[Any]:
    tensor = module.InferInput("INPUT0", [1, 3], "FP32")
    tensor.set_data_from_numpy(np.full((1, 3), value, dtype=np.float32))
    return [tensor]


def test_tritonclient_http_is_served_with_the_key_and_refused_without_it(
    served: ServedProcess,
) -> None:
    with httpclient.InferenceServerClient(served.http_url) as client:
        assert client.is_server_live() and client.is_server_ready()  # probes: no key
        result = client.infer("doubler", _inputs(httpclient, 1.5), headers=dict(HTTP_HEADERS))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[3.0, 3.0, 3.0]])
        for headers in (None, {"Authorization": "Bearer the-environments-key"}):
            with pytest.raises(InferenceServerException) as refused:
                client.infer("doubler", _inputs(httpclient, 1.0), headers=headers)
            assert refused.value.status() == "401"
            assert "Authorization: Bearer <key>" in refused.value.message()
        with pytest.raises(InferenceServerException):
            client.get_model_metadata("doubler")
        assert client.get_model_metadata("doubler", headers=dict(HTTP_HEADERS))["name"] == "doubler"


def test_a_refusal_is_a_401_with_an_error_body_that_never_repeats_a_key(
    served: ServedProcess,
) -> None:
    base = f"http://{served.http_url}"
    for headers in ({}, {"Authorization": "Bearer guessed"}, {"Authorization": KEY}):
        reply = httpx.post(f"{base}/v2/models/doubler/infer", content=b"{", headers=headers)
        assert reply.status_code == 401  # not a 400: the body was not decoded
        assert reply.headers["www-authenticate"] == "Bearer"
        assert set(reply.json()) == {"error"}
        assert "guessed" not in reply.text and KEY not in reply.text
    assert httpx.get(f"{base}/v2/health/live").status_code == 200
    assert httpx.get(f"{base}/v2/health/ready").status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # vLLM's probes: open as on vLLM
    assert httpx.post(f"{base}/ping").status_code == 200
    assert httpx.get(f"{base}/version").status_code == 401  # vLLM leaves it open; not here
    assert httpx.get(f"{base}/metrics").status_code == 200  # open: no --protect-metrics


def test_tritonclient_grpc_is_served_with_the_key_and_refused_without_it(
    served: ServedProcess,
) -> None:
    assert served.grpc_url is not None
    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        # The probes Triton's and KServe's health checks make, without a key:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("doubler")
        result = client.infer("doubler", _inputs(grpcclient, 2.0), headers=GRPC_HEADERS)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[4.0, 4.0, 4.0]])
        for call in (
            lambda: client.infer("doubler", _inputs(grpcclient, 1.0)),
            lambda: client.get_server_metadata(),
            lambda: client.get_model_metadata("doubler", headers={"authorization": "Bearer x"}),
        ):
            with pytest.raises(InferenceServerException) as refused:
                call()
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
            assert "Authorization: Bearer <key>" in refused.value.message()


def _stream(client: grpcclient.InferenceServerClient, headers: dict[str, str] | None) -> Any:
    """One request on a ModelStreamInfer stream: its (result, error)."""
    answered = threading.Event()
    answers: list[Any] = []

    def callback(result: Any, error: Any) -> None:
        answers.append((result, error))
        answered.set()

    client.start_stream(callback=callback, headers=headers)
    # Refused, the stream may end before the request is sent: the callback has the status.
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer("doubler", _inputs(grpcclient, 3.0))
    assert answered.wait(30), "no answer on the stream"
    client.stop_stream()
    return answers[0]


def test_a_grpc_stream_is_served_with_the_key_and_refused_without_it(
    served: ServedProcess,
) -> None:
    assert served.grpc_url is not None
    with grpcclient.InferenceServerClient(served.grpc_url) as client:
        result, error = _stream(client, GRPC_HEADERS)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[6.0, 6.0, 6.0]])
        result, error = _stream(client, None)
        assert result is None and error.status() == "StatusCode.UNAUTHENTICATED"


def test_openai_client_is_served_with_its_api_key_and_refused_with_another(
    served: ServedProcess,
) -> None:
    base_url = f"http://{served.http_url}/v1"
    with openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0) as client:
        assert list(client.models.list()) == []  # answered: the doubler is not an OpenAI model
    with (
        openai.OpenAI(base_url=base_url, api_key="not-it", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as refused,
    ):
        client.models.list()
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"
    assert "not this server's" in refused.value.message


async def test_policy_updates_are_a_403_without_allow_policy_updates(
    served: ServedProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://{served.http_url}/v2/models/doubler/policy"
    async with httpx.AsyncClient(headers=HTTP_HEADERS) as client:
        for changes in ({"timeout_s": 1e-6}, {"max_delay_s": 1e9}, {"max_batch_size": 2}):
            reply = await client.post(url, json=changes)
            assert reply.status_code == 403
            assert "carpool serve --allow-policy-updates" in reply.json()["error"]
        policy = (await client.get(url)).json()  # still shown, unchanged
    assert (policy["max_batch_size"], policy["max_delay_s"]) == (8, 0.001)
    assert policy["timeout_s"] is None
    # carpool tune against it says what the server needs, before any load.
    runner = ServerRunner(f"http://{served.http_url}", "doubler", LoadSpec(), api_key=KEY)
    try:
        with pytest.raises(ConfigError, match="--allow-policy-updates"):
            await runner.start_trial(_trial())
    finally:
        await runner.close()
    # The refused trial changed nothing, so there is nothing to give back (it said the
    # restore of a policy never touched had failed).
    assert "give" not in capsys.readouterr().err


def _trial() -> Any:
    from carpool.tools.tune_trial import TrialConfig

    return TrialConfig((("max_batch_size", 2),))


async def test_metrics_protected_and_bounded_policy_updates(start_server: StartServer) -> None:
    """The key from CARPOOL_API_KEY alone; --protect-metrics; --allow-policy-updates
    with the bounds that keep a policy from breaking the server."""
    served = start_server(
        DOUBLER_CONFIG,
        env={"CARPOOL_API_KEY": KEY},
        args=["--protect-metrics", "--allow-policy-updates"],
    )
    base = f"http://{served.http_url}"
    url = f"{base}/v2/models/doubler/policy"
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{base}/metrics")).status_code == 401
        scraped = await client.get(f"{base}/metrics", headers=HTTP_HEADERS)
        assert "carpool_" in scraped.text
        assert (await client.get(f"{base}/v2/health/ready")).status_code == 200
        assert (await client.post(url, json={"max_batch_size": 2})).status_code == 401
        for changes, bound in (
            ({"timeout_s": 1e-6}, "under 0.001 s"),
            ({"max_delay_s": 1e9}, "over 10.0 s"),
        ):
            reply = await client.post(url, json=changes, headers=HTTP_HEADERS)
            assert reply.status_code == 400 and bound in reply.json()["error"]
        changes = {"timeout_s": 5.0, "max_delay_s": 0.002}
        reply = await client.post(url, json=changes, headers=HTTP_HEADERS)
    assert reply.status_code == 200
    assert (reply.json()["timeout_s"], reply.json()["max_delay_s"]) == (5.0, 0.002)
    with httpclient.InferenceServerClient(served.http_url) as client:
        result = client.infer("doubler", _inputs(httpclient, 0.5), headers=dict(HTTP_HEADERS))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[1.0, 1.0, 1.0]])
    # carpool tune's runner takes the key it is given, and says so when it has none.
    runner = ServerRunner(base, "doubler", LoadSpec())
    try:
        with pytest.raises(ConfigError, match="CARPOOL_API_KEY"):
            await runner.connect()
    finally:
        await runner.close()


@pytest.mark.parametrize(
    ("args", "env", "source"),
    [(["--api-key", ""], {}, "--api-key"), ([], {"CARPOOL_API_KEY": ""}, "CARPOOL_API_KEY")],
)
def test_an_empty_key_is_refused_at_startup(
    args: list[str], env: dict[str, str], source: str
) -> None:
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", *args]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert result.returncode == 2, result.stderr
    assert f"invalid {source}=''" in result.stderr and "non-empty key" in result.stderr
    assert "Traceback" not in result.stderr
