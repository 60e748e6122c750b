"""Peer: PyTriton (NVIDIA Triton server + Python backend stub) serving W1 as model ``mlp``.

Dynamic batching with max_batch_size=64 and max_queue_delay 10 ms. The Python stub needs
LD_LIBRARY_PATH to include the base interpreter's LIBDIR (the driver sets it).

    python pytriton_w1.py --port 8000
    # POST /v2/models/mlp/infer {"inputs":[{"name":"INPUT0","shape":[1,256],...}]}
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
from torch import nn


def build_w1(seed: int = 0) -> nn.Module:
    """Copy of carpool.models.mlp.build_w1 (the peers venv never imports carpool)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(256, 2048),
        nn.GELU(),
        nn.Linear(2048, 2048),
        nn.GELU(),
        nn.Linear(2048, 2048),
        nn.GELU(),
        nn.Linear(2048, 16),
    ).eval()


torch.set_num_threads(1)
MODEL = build_w1()


@batch
def infer(INPUT0: np.ndarray) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        out = MODEL(torch.from_numpy(np.ascontiguousarray(INPUT0, dtype=np.float32)))
    return {"OUTPUT0": out.numpy()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        metrics_address="127.0.0.1",
        metrics_port=args.metrics_port,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="mlp",
            infer_func=infer,
            inputs=[Tensor(name="INPUT0", dtype=np.float32, shape=(256,))],
            outputs=[Tensor(name="OUTPUT0", dtype=np.float32, shape=(16,))],
            config=ModelConfig(
                max_batch_size=64,
                batcher=DynamicBatcher(max_queue_delay_microseconds=10_000),
            ),
        )
        triton.serve()
