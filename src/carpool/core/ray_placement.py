"""A model's Ray replicas reserved together: ``ray_placement: {strategy: ...}``.

Without it each replica's actor is placed by Ray on its own, one after another. With it
the model reserves one bundle per replica (the replica's ``ray_resources``) in one Ray
placement group, all bundles at once or none (gang scheduling), laid out by the
strategy:

    strategy        bundles
    PACK            on as few nodes as fit (the default of Ray)
    SPREAD          across nodes, as evenly as they fit
    STRICT_PACK     all on one node, or the group waits
    STRICT_SPREAD   each on a node of its own, or the group waits

and schedules replica ``i``'s actor into bundle ``i``. An actor that dies comes back in
its bundle; a lost node's bundles are placed again by Ray where the strategy allows. The
group is removed when the model's last replica closes.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from dataclasses import dataclass
from typing import Any

from carpool.core.ray_cluster import import_ray
from carpool.errors import ConfigError

log = logging.getLogger("carpool.replicas")

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RESERVE_WAIT_LOG_S = 30.0  # a group still waiting for Ray to reserve it is logged this often
# ray_resources names that are spelled otherwise in a bundle; any other is kept as it is.
BUNDLE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


@dataclass(frozen=True, slots=True)
class RayPlacement:
    """How a model's replicas are reserved together: a Ray placement group strategy."""

    strategy: str


def check_ray_placement(placement: object) -> RayPlacement | None:
    """``ray_placement``: ``{"strategy": "PACK" | "SPREAD" | "STRICT_PACK" |
    "STRICT_SPREAD"}``, or None (replicas placed one by one).

    Raises:
        ConfigError: not such a mapping.
    """
    if placement is None:
        return None
    expected = f"a mapping {{strategy: S}}, S one of {', '.join(STRATEGIES)}"
    if not isinstance(placement, dict) or set(placement) != {"strategy"}:
        raise ConfigError("ray_placement", placement, expected)
    strategy = placement["strategy"]
    if strategy not in STRATEGIES:
        raise ConfigError("ray_placement.strategy", strategy, f"one of {', '.join(STRATEGIES)}")
    return RayPlacement(strategy)


def bundle_of(resources: dict[str, float]) -> dict[str, float]:
    """The placement-group bundle reserving ``resources`` (``ray_resources`` as checked).

    Raises:
        ConfigError: no amount above 0 (Ray reserves no empty bundle).
    """
    bundle = {BUNDLE_NAMES.get(k, k): v for k, v in resources.items() if v > 0}
    if not bundle:
        raise ConfigError(
            "ray_resources",
            resources,
            "an amount above 0 of some resource with ray_placement (each replica reserves "
            "a bundle of its ray_resources, and Ray reserves no empty one)",
        )
    return bundle


class PlacementGroup:
    """The placement group of one model's replicas: reserved by the first replica that
    loads (:meth:`reserved`), shared by all, removed when the last one closes
    (:meth:`release`)."""

    def __init__(self, name: str, placement: RayPlacement, bundles: list[dict[str, float]]):
        self._name = name
        self._placement = placement
        self._bundles = bundles
        self._group: Any = None
        self._ready: asyncio.Future[None] | None = None
        self._holders: set[int] = set()

    async def reserved(self, replica_id: int) -> Any:
        """Ray's scheduling strategy for replica ``replica_id``'s actor (its bundle), once
        every bundle is reserved (the log says every RESERVE_WAIT_LOG_S while not)."""
        import_ray()  # installed, or a ConfigError saying how
        self._holders.add(replica_id)
        if self._group is None:
            self._group = importlib.import_module("ray.util").placement_group(
                self._bundles, strategy=self._placement.strategy
            )
            self._ready = asyncio.ensure_future(self._wait(self._group.ready()))
        assert self._ready is not None
        await asyncio.shield(self._ready)
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        return strategies.PlacementGroupSchedulingStrategy(
            placement_group=self._group, placement_group_bundle_index=replica_id
        )

    async def _wait(self, ready: Any) -> None:
        waiting = asyncio.ensure_future(ready)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=RESERVE_WAIT_LOG_S)
            if done:
                waiting.result()
                return
            log.warning(
                "model %r: Ray has not reserved its placement group (%s, bundles %s) after "
                "%g s more (the cluster has %s)",
                self._name,
                self._placement.strategy,
                self._bundles,
                RESERVE_WAIT_LOG_S,
                import_ray().cluster_resources(),
            )

    def release(self, replica_id: int) -> None:
        """Replica ``replica_id`` closed; the group goes once every replica that held it
        closed."""
        self._holders.discard(replica_id)
        if self._holders or self._group is None:
            return
        group, self._group = self._group, None
        ready, self._ready = self._ready, None
        if ready is not None and not ready.done() and not ready.get_loop().is_closed():
            ready.cancel()
        try:
            importlib.import_module("ray.util").remove_placement_group(group)
        except Exception:  # Ray shut down, or it is gone already
            log.debug("removing the placement group of model %r failed", self._name)
