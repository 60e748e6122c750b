"""Peer: Ray Serve serving W1 with @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.010).

max_ongoing_requests is raised to 1000 so batches are not capped by Ray's default of 5.

    python rayserve_w1.py --port 8000   # POST /predict {"data": [256 floats]}
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

import ray
import torch
from ray import serve
from starlette.requests import Request
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


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 1})
class W1:
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model = build_w1()

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.010)
    async def infer(self, rows: list[list[float]]) -> list[list[float]]:
        x = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), 256)
        with torch.inference_mode():
            out: list[list[float]] = self.model(x).tolist()
        return out

    async def __call__(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"output": await self.infer(body["data"])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(W1.bind(), route_prefix="/predict", blocking=False)
        print("ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
