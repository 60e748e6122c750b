"""Review of the day's changes (compressed infer answers, REST ``classification: 0``,
the gRPC port held by a plain socket while the models load), on real loopback sockets.

The tests whose docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

import socket
from pathlib import Path

from carpool.server.errors import PortInUse
from carpool.server.repository import ModelRepository

from .conftest import free_port, serve_on_thread, wait_until
from .test_serve_cli_review import MODEL, Gated, _finish, _is_ready, _start


def test_a_second_server_on_the_same_ports_fails_at_once_while_the_first_loads(
    tmp_path: Path,
) -> None:
    """Was: both ports were held, while the models loaded, by sockets bound with
    SO_REUSEADDR and not listening, which Linux lets any other socket with SO_REUSEADDR
    bind as well (uvicorn's, grpcio's, a second ``carpool serve``'s). Before the gRPC
    port was held that way grpcio listened on it, so a second server failed at once; now
    a second ``carpool serve`` on the same ports passed its check, loaded, and took both
    ports over, and the first failed once its models were loaded. The ports are now held
    exclusively (SO_REUSEADDR only where a closed connection's TIME_WAIT needs it)."""
    folder = tmp_path / "gated"
    folder.mkdir()
    gated = Gated(folder, "replica")
    port, grpc_port = free_port(), free_port()
    ports = ("--port", str(port), "--grpc-port", str(grpc_port))
    first = _start(str(gated.config), *ports, cwd=folder, env=gated.env)
    second = None
    try:
        wait_until(lambda: gated.loading.exists() or first.poll() is not None, "loading")
        other = tmp_path / "other"
        other.mkdir()
        (other / "serve.yaml").write_text(MODEL)
        second = _start(str(other / "serve.yaml"), *ports, cwd=other)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: second.poll() is not None or _is_ready(url), "the second to end")
        out = _finish(second)
        assert second.returncode == 3, out
        assert f"port 127.0.0.1:{port}: could not bind" in out, out
        gated.gate.unlink()
        wait_until(lambda: _is_ready(url) or first.poll() is not None, "the first ready")
        assert first.poll() is None
    finally:
        if second is not None and second.poll() is None:
            _finish(second)
        gated.gate.unlink(missing_ok=True)
        out = _finish(first)
    assert first.returncode == 0, out


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
