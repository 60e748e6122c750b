"""The KServe v2 REST face held to what Triton does and ``tritonclient.http`` expects:
request parameters in Triton's units and ranges, and the statistics schema. Each request
goes both to the infer fast path and, with a query string, to the ASGI path, which must
answer alike."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import DOUBLER_CONFIG, start_served_process

CONFIG = DOUBLER_CONFIG

# No query string: the fast path (carpool.server.http.dispatch). A query string: the
# route's handler, in a task (the ids keep their old name, "asgi").
PATHS = [None, {"via": "asgi"}]
PATH_IDS = ["fast", "asgi"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    served = start_served_process(CONFIG, tmp_path_factory.mktemp("kserve-http-review"))
    yield served.http_url
    assert served.stop() == 0, served.output()
    assert "Traceback" not in served.output()


@pytest.fixture
def client(server: str) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server)
    yield client
    client.close()


def _infer(
    client: httpclient.InferenceServerClient, query: dict[str, str] | None, **kwargs: Any
) -> np.ndarray:
    infer_input = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    infer_input.set_data_from_numpy(np.array([[1.5, -2.0]], dtype=np.float32))
    result = client.infer("doubler", [infer_input], query_params=query, **kwargs)
    return result.as_numpy("OUTPUT0")


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_timeout_zero_means_no_timeout(
    client: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    # tritonserver.h, TRITONSERVER_InferenceRequestSetTimeoutMicroseconds: "The default is
    # 0 which indicates that the request has no timeout"; tritonclient sends timeout=0 as
    # given. carpool answered 400 "expected microseconds > 0".
    assert _infer(client, query, timeout=0).tolist() == [[3.0, -4.0]]


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_priority_beyond_the_models_levels_runs_at_the_default_level(
    client: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    # Triton's InferenceRequest::SetPriority: a priority of 0 or above the model's
    # priority_levels gets the default level. carpool (3 levels) answered 400 for 9.
    assert _infer(client, query, priority=9).tolist() == [[3.0, -4.0]]


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [({"priority": -1}, "priority"), ({"priority": 1.5}, "priority"), ({"timeout": -5}, "timeout")],
)
def test_negative_priority_or_timeout_is_still_a_400(
    server: str, query: dict[str, str] | None, parameters: dict[str, Any], fragment: str
) -> None:
    # Triton reads both as unsigned integers and refuses anything else.
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
        "parameters": parameters,
    }
    response = httpx.post(f"http://{server}/v2/models/doubler/infer", json=body, params=query)
    assert response.status_code == 400
    assert fragment in response.json()["error"]


def test_statistics_carry_tritons_cache_fields(client: httpclient.InferenceServerClient) -> None:
    # docs/protocol/extension_statistics.md: $inference_stats has "cache_hit" (not marked
    # #optional), and Triton writes "cache_miss" beside it; perf_analyzer reads both
    # (TritonClientBackend::ParseStatistics). carpool has no response cache: zeros.
    _infer(client, None)
    (stat,) = client.get_inference_statistics("doubler")["model_stats"]
    for key in ("cache_hit", "cache_miss"):
        assert stat["inference_stats"][key] == {"count": 0, "ns": 0}, key


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("request_id", "echoed"), [("", None), ("r-7", "r-7")])
def test_request_id_is_echoed_unless_empty(
    server: str, query: dict[str, str] | None, request_id: str, echoed: str | None
) -> None:
    # Triton's HTTP FinalizeResponse adds "id" only when the request's id is not empty.
    body = {
        "id": request_id,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
    }
    response = httpx.post(f"http://{server}/v2/models/doubler/infer", json=body, params=query)
    assert response.status_code == 200, response.text
    assert response.json().get("id") == echoed
