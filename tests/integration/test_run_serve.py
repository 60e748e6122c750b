"""`carpool.server.run.serve` (the Python API) on real loopback sockets.

The tests whose docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

import socket

import pytest

from carpool import Batcher
from carpool.errors import ConfigError
from carpool.server.errors import PortInUse
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec
from carpool.server.run import serve

from .conftest import free_port, serve_on_thread


def _failing_load(device: str) -> object:
    raise ConfigError("source", "broken:model", "a model that loads")


def _repository_that_fails_to_load() -> ModelRepository:
    batcher = Batcher(fn_factory=_failing_load, name="broken")  # type: ignore[arg-type]
    spec = TensorSpec("x", "FP32", (1,))
    return ModelRepository([ServedModel("broken", "1", "python", (spec,), (spec,), batcher)])


def test_serve_on_a_thread_reports_the_model_load_error_and_frees_its_ports() -> None:
    """Was: ``serve`` run on a thread other than the main one (uvicorn serves there,
    without signal handlers) raised ValueError from ``loop.add_signal_handler`` once its
    ports were bound, and left the HTTP socket open. It now loads the models there as
    well: their error comes back, and both ports are free again."""
    port, grpc_port = free_port(), free_port()
    raised = serve_on_thread(_repository_that_fails_to_load(), port=port, grpc_port=grpc_port)
    assert isinstance(raised, ConfigError), raised
    for free in (port, grpc_port):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", free))  # raises when a socket still holds it


def test_a_taken_http_port_leaves_the_grpc_port_free() -> None:
    """Was: the gRPC server, bound before the HTTP port was found taken, was stopped
    without having started, which gRPC's core answers by keeping the port listening
    for the rest of the process."""
    grpc_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PortInUse, match=f"HTTP port 127.0.0.1:{taken.getsockname()[1]}"):
            serve(ModelRepository([]), port=taken.getsockname()[1], grpc_port=grpc_port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", grpc_port))  # raises when gRPC still holds it


def test_serve_with_one_port_for_both_wires_fails_at_once_naming_it() -> None:
    """Was: ``serve(port=P, grpc_port=P)`` (the CLI refuses it; the Python API does not)
    bound P twice, both non-listening with SO_REUSEADDR, loaded the models, let grpcio
    listen on P and then crashed with AttributeError when uvicorn could not listen.
    Before the gRPC port was held by a plain socket it was PortInUse at once."""
    port = free_port()
    raised = serve_on_thread(ModelRepository([]), port=port, grpc_port=port)
    assert isinstance(raised, PortInUse), raised
    assert f"HTTP port 127.0.0.1:{port}: could not bind" in str(raised)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises when a socket still holds it
