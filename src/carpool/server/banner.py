"""What `carpool serve` says when it is ready and when it stops.

Triton prints its model table and the addresses it listens on; a person starting a
server wants to know the same: which models, with which batching, where to send
requests, and how to stop it without losing any.
"""

from __future__ import annotations

import logging

from carpool import __version__
from carpool.core import allocator
from carpool.server.repository import ModelRepository, ServedModel

logger = logging.getLogger("carpool.server")


# Where a model says which kernel it fell back to (carpool.models.onednn): a CPU that
# lacks a path must say so in the server's output, not only in a debug log.
_models_logger = logging.getLogger("carpool.models")


def use_default_logging() -> None:
    """Lines of ``carpool.server`` and ``carpool.models`` on stderr at INFO, unless the
    process configured logging itself (an application embedding the server)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not _models_logger.handlers:  # no root handler either: nothing printed twice
        _models_logger.addHandler(handler)
        _models_logger.setLevel(logging.INFO)


def ready_lines(repository: ModelRepository, http: str, grpc: str | None) -> list[str]:
    """The startup summary: one line per model, then the addresses."""
    models = list(repository)
    width = max((len(m.name) for m in models), default=0)
    lines = [f"carpool {__version__}: {len(models)} model(s) ready"]
    for model in models:
        lines.append(f"  {model.name:<{width}}  {_describe(model)}")
    lines.append(f"HTTP  http://{http}  KServe v2 /v2, OpenAI /v1, Prometheus /metrics")
    if grpc is not None:
        lines.append(f"gRPC  {grpc}  KServe v2 inference.GRPCInferenceService")
    malloc = allocator.setting()
    if malloc is not None:  # carpool serve set the process's allocator before the models
        lines.append(malloc)
    lines.append("SIGINT or SIGTERM: stop accepting, answer every accepted request, exit 0")
    return lines


def _describe(model: ServedModel) -> str:
    batcher = model.batcher
    if batcher is None:  # a generation model: its engine schedules every step
        return "generation: continuous batching, /v1/completions and /v1/chat/completions"
    policy = batcher.policy
    delay = policy.max_delay_s
    within = "an adaptive delay" if isinstance(delay, str) else f"{delay * 1e3:g} ms"
    batching = f"batch <= {policy.max_batch_size} within {within}"
    replicas = batcher.num_replicas
    if replicas > 1:
        batching += f", {replicas} replicas"
    if model.embeddings is not None:
        return f"embeddings ({model.platform}): {batching}, /v1/embeddings"
    return f"{model.platform}: {batching}"
