"""How `carpool serve` holds its ports while the models load (``_bind_port``).

Was: an IPv6 gRPC port was held IPv6-only, so with ``--host ::`` its IPv4 side was free
while the models loaded, for any other process to take; grpcio then binds "[::]:port"
for both families and failed after the whole load. HTTP stays IPv6-only, as asyncio's
create_server binds it."""

from __future__ import annotations

import socket

import pytest

from carpool.server.run import _bind_port, _close


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 here")
@pytest.mark.parametrize(("wire", "v6only"), [("gRPC", 0), ("HTTP", 1)])
def test_an_ipv6_wildcard_port_is_held_as_its_server_binds_it(wire: str, v6only: int) -> None:
    """Bound, never listening (nothing is served): Linux makes a socket bound to one IPv6
    address (::1) IPv6-only whatever it asked, so only the wildcard shows the option."""
    sockets = _bind_port("::", 0, wire=wire)
    try:
        (sock,) = sockets
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == v6only
        if wire == "gRPC":  # its IPv4 side is held too
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", sock.getsockname()[1]))
    finally:
        _close(sockets)


def test_an_ipv4_port_is_held_without_reuseaddr_and_refuses_a_second_holder() -> None:
    sockets = _bind_port("127.0.0.1", 0, wire="gRPC")
    try:
        (sock,) = sockets
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 0
        port = sock.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    finally:
        _close(sockets)
