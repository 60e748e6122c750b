"""The models ``carpool serve`` serves when given no configuration."""

from __future__ import annotations

from typing import Any

from carpool.core.batcher import Batcher
from carpool.core.policy import BatchPolicy
from carpool.server.repository import ServedModel, TensorSpec


def _w1_factory(device: str) -> Any:
    from carpool.models.mlp import make_w1

    runner = make_w1(device)

    def w1(inputs: dict[str, Any]) -> dict[str, Any]:
        return {"OUTPUT0": runner(inputs["INPUT0"])}

    return w1


def default_models() -> list[ServedModel]:
    """``mlp``: the reference MLP W1 (256 float32 in, 16 out), batched up to 64 within 2 ms."""
    from carpool.models.mlp import W1_INPUT_DIM, W1_OUTPUT_DIM

    mlp = Batcher(
        fn_factory=_w1_factory,
        policy=BatchPolicy(max_batch_size=64, max_delay_s=0.002),
        name="mlp",
        collate="dict",
    )
    return [
        ServedModel(
            name="mlp",
            version="1",
            platform="pytorch",
            inputs=(TensorSpec("INPUT0", "FP32", (W1_INPUT_DIM,)),),
            outputs=(TensorSpec("OUTPUT0", "FP32", (W1_OUTPUT_DIM,)),),
            batcher=mlp,
        )
    ]
