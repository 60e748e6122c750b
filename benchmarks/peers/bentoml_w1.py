"""Peer: BentoML serving W1 with adaptive batching (max_batch_size=64, max_latency_ms=10).

BentoML has no fixed batch wait timeout: its dispatcher sizes batches adaptively under the
``max_latency_ms`` budget (requests it predicts would exceed that are rejected with 503).
Override the budget with W1_BENTO_MAX_LATENCY_MS.

    bentoml serve bentoml_w1:W1 --working-dir benchmarks/peers --host 127.0.0.1 --port 8000
    # POST /predict {"data": [[256 floats]]}  ->  [[16 floats]]
"""

from __future__ import annotations

import os

import bentoml
import numpy as np
import torch
from torch import nn

MAX_LATENCY_MS = int(os.environ.get("W1_BENTO_MAX_LATENCY_MS", "10"))


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


@bentoml.service(workers=1, traffic={"max_concurrency": 1000, "timeout": 60})
class W1:
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model = build_w1()

    @bentoml.api(batchable=True, batch_dim=0, max_batch_size=64, max_latency_ms=MAX_LATENCY_MS)
    def predict(self, data: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(-1, 256)
        with torch.inference_mode():
            return self.model(x).numpy()
