"""The reference workload W1: a four-layer PyTorch MLP, one request = 256 float32 values.

``Linear(256, 2048) - GELU - Linear(2048, 2048) - GELU - Linear(2048, 2048) - GELU -
Linear(2048, 16)``, float32, weights from ``torch.manual_seed(0)``, eval mode, run under
``torch.inference_mode()``. The benchmarks and ``make serve`` use it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from carpool.core.stepwise import run_to_end

if TYPE_CHECKING:
    from carpool.models.torch import TorchRunner

W1_INPUT_DIM = 256
W1_OUTPUT_DIM = 16
W1_HIDDEN_DIM = 2048
# W1Runner.steps computes a 2048 x 2048 layer this many slices of its outputs at a time,
# for batches of at least W1_SLICED_ROWS rows (a smaller batch's whole layer is a short step).
W1_LAYER_SLICES = 4
W1_SLICED_ROWS = 4


def build_w1(seed: int = 0) -> Any:
    """The W1 module with deterministic weights (``torch.manual_seed(seed)``), in eval mode."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(W1_INPUT_DIM, W1_HIDDEN_DIM),
        nn.GELU(),
        nn.Linear(W1_HIDDEN_DIM, W1_HIDDEN_DIM),
        nn.GELU(),
        nn.Linear(W1_HIDDEN_DIM, W1_HIDDEN_DIM),
        nn.GELU(),
        nn.Linear(W1_HIDDEN_DIM, W1_OUTPUT_DIM),
    )
    return model.eval()


class W1Runner:
    """A batched callable: ``(n, 256)`` float32 NumPy array in, ``(n, 16)`` out."""

    def __init__(self, seed: int = 0, device: str = "cpu") -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.model = build_w1(seed).to(self.device)

    def __call__(self, batch: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = run_to_end(self.steps(batch))
        return out

    def steps(
        self, batch: npt.NDArray[np.float32]
    ) -> Generator[None, None, npt.NDArray[np.float32]]:
        """The same in steps of at most a quarter of a 2048 x 2048 layer's work at a large
        batch, yielding between them: on the event loop's thread the server reads and
        refuses requests between steps (carpool.core.stepwise) rather than only after the
        whole batch. A large layer
        is computed :data:`W1_LAYER_SLICES` slices of its outputs at a time (the same sums,
        bit for bit, and no slower), in batches of :data:`W1_SLICED_ROWS` rows or more:
        below that a whole layer is about a millisecond, and slices would only add calls.
        Each step runs under inference mode on its own, so that no other code on the loop
        runs inside it."""
        torch = self._torch
        functional = torch.nn.functional
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).to(self.device)
        slices = W1_LAYER_SLICES if batch.shape[0] >= W1_SLICED_ROWS else 1
        for layer in self.model:
            if not (isinstance(layer, torch.nn.Linear) and layer.out_features == W1_HIDDEN_DIM):
                with torch.inference_mode():
                    x = layer(x)
                continue
            yield
            width = layer.out_features // slices
            parts: list[Any] = []
            for start in range(0, layer.out_features, width):
                if parts:
                    yield
                rows = slice(start, start + width)
                with torch.inference_mode():
                    parts.append(functional.linear(x, layer.weight[rows], layer.bias[rows]))
            with torch.inference_mode():
                x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        with torch.inference_mode():
            out: npt.NDArray[np.float32] = x.cpu().numpy()
        return out


def make_w1(device: str = "cpu") -> W1Runner:
    """Factory for ``Batcher(fn_factory=...)``: one W1 copy per replica device."""
    return W1Runner(device=device)


def w1_torch_runner(device: str = "cpu", dtype: str | None = None) -> TorchRunner:
    """W1 behind the torch runner, as ``kind: torch`` serves ``carpool.models.mlp:build_w1``
    with inputs ``INPUT0`` [256] and outputs ``OUTPUT0`` [16] (FP32), on ``device`` in
    ``dtype``."""
    from carpool.models.torch import TorchRunner

    return TorchRunner(
        build_w1(),
        input_names=["INPUT0"],
        output_names=["OUTPUT0"],
        device=device,
        dtype=dtype,
        output_dtypes=[np.dtype(np.float32)],
    )
