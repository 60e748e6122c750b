"""Peer: plain FastAPI + uvicorn serving W1, one request = one forward pass (no batching).

python fastapi_w1.py --port 8000   # POST /predict {"data": [256 floats]}
"""

from __future__ import annotations

import argparse

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
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
app = FastAPI()


class Request(BaseModel):
    data: list[float]


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/predict")
def predict(request: Request) -> dict[str, list[float]]:
    with torch.inference_mode():
        out = MODEL(torch.tensor(request.data, dtype=torch.float32).reshape(1, 256))
    return {"output": out[0].tolist()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
