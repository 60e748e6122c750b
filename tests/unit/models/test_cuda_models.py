"""The torch runner, the BERT encoder and the memory probe on a CUDA GPU.

These need a GPU that torch can use and are skipped anywhere else (CI has none). Their last
run on one is recorded in docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from carpool.models.bert import ATTENTION_VARIANTS, BertConfig, BertEncoder, Segments
from carpool.models.mlp import build_w1, w1_torch_runner
from carpool.models.torch import CudaMemoryProbe, GpuMemorySampler

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none here"
)

# Worst absolute error allowed, as a share of the largest reference value: float32 on the
# GPU differs from the CPU only in summation order; float16 and bfloat16 keep 11 and 8 bits.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_torch_runner_runs_in_the_device_and_dtype_it_is_given(dtype: str) -> None:
    x = np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32)
    with torch.inference_mode():
        want = build_w1()(torch.from_numpy(x)).numpy()
    runner = w1_torch_runner("cuda:0", dtype)
    parameter = next(runner.module.parameters())
    assert (parameter.device.type, parameter.dtype) == ("cuda", getattr(torch, dtype))
    got = runner({"INPUT0": x})["OUTPUT0"]
    assert got.dtype == np.float32 and got.shape == (64, 16)
    _close(got, want, dtype)


SMALL: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "hidden_act": "gelu",
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}
LENGTHS = [1, 7, 30, 2, 64, 13]


@pytest.fixture(scope="module")
def reference() -> tuple[BertEncoder, torch.Tensor, torch.Tensor]:
    """(the encoder on the CPU in float32, packed token ids, what it gives for them)."""
    torch.manual_seed(0)
    encoder = BertEncoder(BertConfig.from_dict(SMALL)).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(1, 100, (n,), generator=generator) for n in LENGTHS])
    with torch.inference_mode():
        want = encoder.forward_packed(ids, _segments("cpu"), attention="loop")
    return encoder, ids, want


def _segments(device: str) -> Segments:
    cu_seqlens = torch.tensor([0, *np.cumsum(LENGTHS)], dtype=torch.int32, device=device)
    return Segments.from_cu_seqlens(cu_seqlens)


CASES = [
    (attention, dtype)
    for dtype in ("float32", "float16", "bfloat16")
    for attention in ATTENTION_VARIANTS
    if not (attention == "varlen" and dtype == "float32")  # FlashAttention has no float32
]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize(("attention", "dtype"), CASES)
def test_every_attention_variant_runs_on_the_gpu_as_on_the_cpu(
    reference: tuple[BertEncoder, torch.Tensor, torch.Tensor], attention: str, dtype: str
) -> None:
    encoder, ids, want = reference
    gpu = BertEncoder(BertConfig.from_dict(SMALL)).eval()
    gpu.load_state_dict(encoder.state_dict())
    gpu = gpu.to(device="cuda:0", dtype=getattr(torch, dtype))
    with torch.inference_mode():
        got = gpu.forward_packed(ids.to("cuda:0"), _segments("cuda:0"), attention=attention)
    assert got.device.type == "cuda" and got.dtype == getattr(torch, dtype)
    _close(got.float().cpu().numpy(), want.numpy(), dtype)


def test_the_memory_sampler_reports_the_peak_since_its_last_sample() -> None:
    sampler = GpuMemorySampler(0, interval_s=0.0)
    first, total = sampler.sample()  # what is allocated now, not the peak of loading
    assert first == torch.cuda.memory_allocated(0)
    assert total == torch.cuda.get_device_properties(0).total_memory
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")  # 256 MiB
    del block
    peak, _ = sampler.sample()
    assert peak >= first + (256 << 20)
    after, _ = sampler.sample()  # the block was freed before this stretch
    assert after < peak - (128 << 20)
    held = GpuMemorySampler(0, interval_s=3600.0)
    sample = held.sample()
    kept = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    assert held.sample() == sample  # within the interval the last sample is repeated
    del kept


def test_probes_on_one_gpu_share_its_sampler() -> None:
    first, second = CudaMemoryProbe([0]), CudaMemoryProbe([0])
    assert first() == second()  # one sample of the GPU, not one each cutting the other's
    assert first._samplers[0] is GpuMemorySampler.of(0) is second._samplers[0]
