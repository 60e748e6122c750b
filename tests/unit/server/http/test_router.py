"""The one router (carpool.server.http.router): a method and path to the route that
answers it, what is refused from the head, and the plain infer targets the fast path
keeps."""

from __future__ import annotations

import pytest

from carpool import Batcher
from carpool.server.access import DEFAULT_ACCESS, Access
from carpool.server.errors import (
    MethodNotAllowed,
    NotFound,
    NotSupported,
    PolicyUpdatesOff,
    Unauthorized,
)
from carpool.server.http.headers import RequestHeaders
from carpool.server.http.router import HttpRequest, RouteKind, infer_model, route
from carpool.server.repository import ModelRepository, ServedModel

from .fakes import SPEC_IN, SPEC_OUT


@pytest.fixture
def repository() -> ModelRepository:
    served = ServedModel("m", "1", "python", (SPEC_IN,), (SPEC_OUT,), Batcher(lambda x: x))
    return ModelRepository([served])


def _request(method: str, path: str, authorization: bytes | None = None) -> HttpRequest:
    return HttpRequest(method, path, b"", RequestHeaders(authorization=authorization), 0.0)


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("GET", "/v2/health/live", RouteKind.HEALTH_LIVE),
        ("HEAD", "/v2/health/ready", RouteKind.HEALTH_READY),
        ("GET", "/health", RouteKind.HEALTH_READY),  # vLLM's probes: readiness
        ("GET", "/ping", RouteKind.HEALTH_READY),
        ("POST", "/ping", RouteKind.HEALTH_READY),
        ("GET", "/version", RouteKind.VERSION),
        ("GET", "/v2", RouteKind.SERVER_METADATA),
        ("GET", "/v2/models/stats", RouteKind.MODELS_STATS),
        ("GET", "/v2/timelines", RouteKind.TIMELINES),
        ("POST", "/v2/repository/index", RouteKind.REPOSITORY_INDEX),
        ("POST", "/v2/models/m/infer", RouteKind.INFER),
        ("POST", "/v2/models/m/versions/1/infer", RouteKind.INFER),
        ("POST", "//v2/models/m//infer/", RouteKind.INFER),  # empty segments dropped
        ("GET", "/v2/models/m/policy", RouteKind.POLICY_GET),
        ("GET", "/v2/models/m", RouteKind.MODEL_METADATA),
        ("GET", "/v2/models/m/ready", RouteKind.MODEL_READY),
        ("GET", "/v2/models/m/config", RouteKind.MODEL_CONFIG),
        ("GET", "/v2/models/m/stats", RouteKind.MODEL_STATS),
        ("POST", "/v1/embeddings", RouteKind.EMBEDDINGS),
        ("GET", "/v1/models", RouteKind.OPENAI_MODELS),
        ("GET", "/v1/models/org/name", RouteKind.OPENAI_MODEL),
        ("POST", "/v1/completions", RouteKind.COMPLETIONS),
        ("POST", "/v1/chat/completions", RouteKind.CHAT_COMPLETIONS),
        ("GET", "/metrics", RouteKind.METRICS),
    ],
)
def test_every_path_has_its_route(
    repository: ModelRepository, method: str, path: str, kind: RouteKind
) -> None:
    assert route(repository, DEFAULT_ACCESS, _request(method, path)).kind is kind


@pytest.mark.parametrize(
    ("method", "path", "error"),
    [
        ("POST", "/v2/models/nope/infer", NotFound),  # the model is looked up first
        ("GET", "/v2/models/m/infer", MethodNotAllowed),
        ("GET", "/v2/models/m/versions/9", NotFound),
        ("GET", "/v2/systemsharedmemory/status", NotSupported),
        ("GET", "/v2/models/m/trace/setting", NotSupported),
        ("POST", "/v2/models/m/policy", PolicyUpdatesOff),
        ("GET", "/v1/anything", NotFound),
        ("GET", "/elsewhere", NotFound),
    ],
)
def test_what_the_head_alone_refuses(
    repository: ModelRepository, method: str, path: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        route(repository, DEFAULT_ACCESS, _request(method, path))


def test_the_api_key_is_checked_before_the_path(repository: ModelRepository) -> None:
    access = Access("k3y")
    with pytest.raises(Unauthorized):
        route(repository, access, _request("GET", "/v2/models/nope"))
    assert (
        route(repository, access, _request("GET", "/v2/health/live")).kind is RouteKind.HEALTH_LIVE
    )
    keyed = _request("GET", "/v2/models/m", authorization=b"Bearer k3y")
    assert route(repository, access, keyed).kind is RouteKind.MODEL_METADATA


@pytest.mark.parametrize(
    ("url", "is_kept"),
    [
        (b"/v2/models/m/infer", True),
        (b"/v2/models/m/versions/1/infer", True),
        (b"/v2/models/m/infer?x=1", False),  # a query, an escape, an empty segment:
        (b"/v2/models/%6d/infer", False),  # routed as any other path
        (b"/v2/models/m//infer", False),
        (b"/v2/models/m/infer/", False),
        (b"/v2/models/nope/infer", False),
        (b"/v2/models/m/versions/2/infer", False),
        (b"/v2/repository/infer", False),
        (b"/v1/infer", False),
    ],
)
def test_only_plain_targets_of_served_models_are_infer_targets(
    repository: ModelRepository, url: bytes, is_kept: bool
) -> None:
    assert (infer_model(repository, DEFAULT_ACCESS, url) is not None) == is_kept


def test_a_model_id_with_slashes_is_kept_whole(repository: ModelRepository) -> None:
    found = route(repository, DEFAULT_ACCESS, _request("GET", "/v1/models/org/name"))
    assert found.name == "org/name"
    with pytest.raises(MethodNotAllowed):
        route(repository, DEFAULT_ACCESS, _request("POST", "/v1/models/org/name"))
