"""``carpool serve --workers N``: front-end worker processes sharing the ports, handing
their requests to the engine process that owns every batcher
(:mod:`carpool.server.workers.engine`)."""

from carpool.server.workers.engine import PortReservation, reserve_ports, serve_workers

__all__ = ["PortReservation", "reserve_ports", "serve_workers"]
