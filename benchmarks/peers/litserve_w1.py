"""Peer: LitServe serving W1 with dynamic batching (max_batch_size=64, batch_timeout=10 ms).

python litserve_w1.py --port 8000   # POST /predict {"data": [256 floats]}
"""

from __future__ import annotations

import argparse

import litserve as ls
import torch
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


class W1API(ls.LitAPI):
    def setup(self, device: str) -> None:
        torch.set_num_threads(1)
        self.model = build_w1()

    # No annotations on decode_request/encode_response: LitServe turns them into the FastAPI
    # endpoint's types (here strings, from the __future__ import), which breaks JSON parsing.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return request["data"]

    def batch(self, inputs: list[list[float]]) -> torch.Tensor:
        return torch.tensor(inputs, dtype=torch.float32).reshape(len(inputs), 256)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(x)

    def unbatch(self, output: torch.Tensor) -> list[list[float]]:
        return output.tolist()

    def encode_response(self, output):  # type: ignore[no-untyped-def]
        return {"output": output}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    api = W1API(max_batch_size=64, batch_timeout=0.010)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False)
