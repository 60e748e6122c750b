"""The Ray cluster that ``executor="ray"`` replicas run on: connecting, and their options.

Ray is an optional extra (``pip install 'carpool[ray]'``), imported only here and in
:mod:`carpool.core.ray_replica`, and only when a model asks for it. The connection is the
process's own (Ray keeps one per process): ``carpool serve --ray-address ADDR`` or a
config's ``ray: {address: ...}`` connects at start-up (:func:`connect`); otherwise the
first Ray replica to load connects as ``ray.init()`` does by itself
(:func:`ensure_connected`): to the cluster ``RAY_ADDRESS`` names, else a local one it
starts, sized to this machine's CPUs, and says so in the log.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from carpool.core.replicas import usable_cpus
from carpool.errors import ConfigError

log = logging.getLogger("carpool.replicas")

INSTALL_HINT = "pip install 'carpool[ray]'"
DEFAULT_RAY_RESOURCES: dict[str, float] = {"num_cpus": 1.0}
DEFAULT_MAX_RESTARTS = 3
# Keys of ray_resources that are arguments of .options(...); any other is a custom resource.
OPTION_RESOURCES = ("num_cpus", "num_gpus", "memory")


def import_ray() -> ModuleType:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed, saying how to install it.
    """
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise ConfigError(
            "executor",
            "ray",
            f"Ray installed for executor: ray ({INSTALL_HINT}; importing it failed: {exc})",
        ) from None


def check_ray_resources(resources: object) -> dict[str, float]:
    """``ray_resources``: resource names (strings) to amounts (numbers >= 0); None gives
    ``DEFAULT_RAY_RESOURCES``.

    Raises:
        ConfigError: not a mapping of names to finite numbers >= 0.
    """
    if resources is None:
        return dict(DEFAULT_RAY_RESOURCES)
    expected = "a mapping of Ray resource names to numbers >= 0, as {num_cpus: 1, num_gpus: 1}"
    if not isinstance(resources, dict):
        raise ConfigError("ray_resources", resources, expected)
    checked: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise ConfigError("ray_resources", resources, f"{expected}; {name!r} is no name")
        if (
            isinstance(amount, bool)
            or not isinstance(amount, int | float)
            or not math.isfinite(amount)
            or amount < 0
        ):
            raise ConfigError(f"ray_resources.{name}", amount, "a number >= 0")
        checked[name] = float(amount)
    return checked


def check_max_restarts(max_restarts: object) -> int:
    """``max_restarts``: how often Ray restarts a dead actor itself (-1: without end).

    Raises:
        ConfigError: not an integer >= -1.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ConfigError("max_restarts", max_restarts, "an integer >= -1 (-1: no limit)")
    return max_restarts


@dataclass(frozen=True, slots=True)
class RayOptions:
    """How a model's Ray actors are placed and restarted: ``resources`` as checked by
    :func:`check_ray_resources`, ``max_restarts`` as Ray's own actor option."""

    resources: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RAY_RESOURCES))
    max_restarts: int = DEFAULT_MAX_RESTARTS

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments of ``ray.remote(...).options(...)``."""
        options: dict[str, Any] = {"max_restarts": self.max_restarts}
        custom: dict[str, float] = {}
        for name, amount in self.resources.items():
            if name in OPTION_RESOURCES:
                options[name] = int(amount) if name == "memory" else amount
            else:
                custom[name] = amount
        if custom:
            options["resources"] = custom
        return options


def connect(
    address: str | None, namespace: str | None = None, runtime_env: dict[str, Any] | None = None
) -> None:
    """Connect this process to the Ray cluster at ``address`` (``"auto"``: the one
    running on this machine), unless it is connected already.

    Raises:
        ConfigError: Ray is not installed.
    """
    ray = import_ray()
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"address": address, "namespace": namespace}
    if runtime_env is not None:
        kwargs["runtime_env"] = runtime_env
    try:
        with _signals_kept():
            ray.init(**kwargs)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        expected = "the address of a running Ray cluster, or 'auto' for the one on this machine"
        raise ConfigError("ray.address", address, f"{expected} ({exc})") from None
    log.info("connected to the Ray cluster at %s", address or "RAY_ADDRESS")


def ensure_connected() -> None:
    """Connect to Ray as :func:`connect` would, where nothing connected yet: to the cluster
    ``RAY_ADDRESS`` names, else a local one started now (said in the log)."""
    ray = import_ray()
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        connect(address)
        return
    num_cpus = usable_cpus()
    with _signals_kept():
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    global _started_here
    _started_here = True
    log.warning(
        "no Ray cluster given (--ray-address, ray: {address: ...} in the config, or "
        "RAY_ADDRESS): started a local one with num_cpus=%d (the CPUs this process may "
        "run on) for executor: ray; it stops with this process",
        num_cpus,
    )


_started_here = False  # whether ensure_connected started a local Ray


def stop_local() -> None:
    """Stop the local Ray :func:`ensure_connected` started, if it did: a process that
    ends without its exit hooks (``os._exit``, on a signal while the models load) would
    leave Ray's own processes running. Nothing otherwise."""
    global _started_here
    if _started_here:
        _started_here = False
        import_ray().shutdown()


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """Around ``ray.init``: the handlers of SIGINT and SIGTERM put back after it. Ray's
    own SIGTERM handler dumps its state and exits 15; carpool serve answers a signal
    itself (while its models load, it ends with status 0 saying so)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:
                signal.signal(signum, handler)
