"""The OTLP endpoint of ``carpool serve --otlp-endpoint`` (carpool.server.otlp); the
spans themselves are checked against a collector in tests/integration/test_otlp_export.py."""

from __future__ import annotations

import pytest

from carpool.errors import ConfigError
from carpool.server.otlp import traces_url


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otel.example/custom/path", "https://otel.example/custom/path"),
    ],
)
def test_a_base_address_gets_the_traces_path(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize("endpoint", ["collector:4318", "grpc://collector:4317", "http://"])
def test_an_endpoint_that_is_no_http_url_is_refused(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="otlp-endpoint"):
        traces_url(endpoint)
