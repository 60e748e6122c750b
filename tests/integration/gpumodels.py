"""A torch model the GPU tests serve from a config (tests/integration/test_cuda_serving.py)."""

from __future__ import annotations

import torch


class Hog(torch.nn.Module):
    """``y = 2 * x``, holding a third of the GPU's memory per request while it runs: a batch
    of 3 or more cannot fit, a batch of 2 can, so torch's CUDA allocator raises
    ``torch.OutOfMemoryError`` for any batch over 2."""

    def __init__(self) -> None:
        super().__init__()
        self.share_bytes = torch.cuda.get_device_properties(0).total_memory // 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = torch.empty(x.shape[0] * self.share_bytes, dtype=torch.uint8, device=x.device)
        block[-1] = 1  # written, so the memory is really used
        return x * 2 + block[-1].float() - 1


def hog() -> torch.nn.Module:
    return Hog()
