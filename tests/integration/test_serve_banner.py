"""What `carpool serve` tells the person who started it: models, addresses, stopping."""

from __future__ import annotations

from .conftest import StartServer
from .test_serve_config import CONFIG as SERVE_CONFIG

# The python model of the serve-config tests, without the ONNX one (its file is built there).
CONFIG = SERVE_CONFIG.split("  - name: affine")[0]


def test_ready_lines_name_models_and_addresses_and_stopping_is_said(
    start_server: StartServer,
) -> None:
    served = start_server(CONFIG, grpc=True)
    ready = served.output()
    assert "carpool " in ready and "1 model(s) ready" in ready
    assert "doubler  python: batch <= 16 within 1 ms" in ready
    assert f"HTTP  http://{served.http_url}  KServe v2 /v2" in ready
    assert f"gRPC  {served.grpc_url}  KServe v2" in ready
    assert "malloc: " in ready  # what carpool.core.allocator did, whatever the machine
    assert served.stop() == 0
    lines = served.output().splitlines()
    assert lines[-2:] == ["stopping: no new requests; answering the accepted ones", "stopped"]
