"""carpool's packed Linear kernel (csrc/packed_linear.cpp): equal to F.linear on every
shape edge, refusing what it cannot take, and chosen by the runner where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool.generation.llama import LlamaConfig, LlamaModel
from carpool.generation.paged_decode import PACKED_LINEAR, KernelBuild, load_kernel
from carpool.generation.runner import FastLinear, ModelRunner
from carpool.generation.types import SeqChunk, StepInput
from carpool.models import onednn
from carpool.tools import machine


@pytest.fixture(scope="module")
def kernel_build() -> KernelBuild:
    build = load_kernel()
    assert build.is_available, build.reason
    return build


def _check(rows: int, inputs: int, outputs: int, with_bias: bool, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator)
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    packed = torch.ops.carpool.pack_linear(weight)
    got = torch.ops.carpool.packed_linear(x, packed, bias, outputs)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    # float32 sums of `inputs` products in another order: relative to the products' size
    tolerance = 1e-5 * (inputs**0.5 + 1) * 4
    scale = float(x.abs().max() * weight.abs().max()) if rows and outputs and inputs else 1.0
    if got.numel():
        assert float((got.double() - want).abs().max()) <= tolerance * scale


# Rows on both sides of the row tiles (8 with AVX-512, 4 with AVX2, then 2 and 1), outputs
# on both sides of a panel (32 or 16), inputs of one, odd and model sizes.
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("outputs", [1, 15, 16, 17, 31, 32, 33, 100])
def test_equals_f_linear_on_every_edge_of_the_tiles(
    kernel_build: KernelBuild, rows: int, outputs: int
) -> None:
    _check(rows, 37, outputs, with_bias=outputs % 2 == 1, seed=rows * 100 + outputs)


@pytest.mark.parametrize(
    ("inputs", "with_bias"), [(1, True), (16, False), (768, True), (2048, False)]
)
def test_equals_f_linear_for_model_sized_inputs(
    kernel_build: KernelBuild, inputs: int, with_bias: bool
) -> None:
    _check(8, inputs, 96, with_bias)
    _check(300, inputs, 50, with_bias)  # a prefill chunk's worth of rows


def test_two_threads_give_what_one_gives(kernel_build: KernelBuild) -> None:
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(9, 64, generator=generator), torch.randn(200, 64, generator=generator)
    packed = torch.ops.carpool.pack_linear(weight)
    threads = torch.get_num_threads()
    outs = []
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            outs.append(torch.ops.carpool.packed_linear(x, packed, None, 200))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])  # each panel's sums are one thread's, in one order


def test_refuses_what_it_cannot_take_naming_it(kernel_build: KernelBuild) -> None:
    weight = torch.randn(20, 8)
    packed = torch.ops.carpool.pack_linear(weight)
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.carpool.packed_linear(torch.randn(2, 8, dtype=torch.float64), packed, None, 20)
    with pytest.raises(RuntimeError, match="x has 9 columns, the weight 8"):
        torch.ops.carpool.packed_linear(torch.randn(2, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="out_features 100 does not fit"):
        torch.ops.carpool.packed_linear(torch.randn(2, 8), packed, None, 100)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        torch.ops.carpool.packed_linear(torch.randn(2, 8), packed, torch.randn(3), 20)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        torch.ops.carpool.pack_linear(weight.double())


def test_fast_linear_keeps_leading_dimensions(kernel_build: KernelBuild) -> None:
    torch.manual_seed(0)
    layer = FastLinear(24, 40)
    x = torch.randn(3, 5, 24)
    want = F.linear(x, layer.weight, layer.bias)
    layer.prepack(PACKED_LINEAR)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (3, 5, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# 2 * 96 gate/up outputs: several panels and a partial one
LLAMA = LlamaConfig(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def _logits() -> tuple[str, torch.Tensor]:
    torch.manual_seed(0)
    runner = ModelRunner(LlamaModel(LLAMA), 16, 16)
    chunk = SeqChunk(1, tuple(range(3, 40)), 0, (0, 1, 2), needs_logits=True)
    return runner.linear_path, runner.compute_logits(StepInput((chunk,)))


def test_the_runner_packs_for_its_kernel_and_onednn_when_asked(
    kernel_build: KernelBuild, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, packed = _logits()
    assert path == PACKED_LINEAR
    monkeypatch.setenv(onednn.LINEAR_KERNEL_ENV, "onednn")
    path, prepacked = _logits()
    assert path == onednn.kernel_name(onednn.can_prepack(torch.float32))
    monkeypatch.setenv(
        onednn.LINEAR_KERNEL_ENV, "aten"
    )  # the runner's choice; oneDNN's probe is cached
    path, _ = _logits()
    assert path != PACKED_LINEAR
    torch.testing.assert_close(packed, prepacked, rtol=1e-4, atol=1e-4)


def test_the_model_names_its_kernel_to_the_machine_report(kernel_build: KernelBuild) -> None:
    torch.manual_seed(0)
    runner = ModelRunner(LlamaModel(LLAMA), 16, 16)
    assert onednn.linear_path(runner.model) == PACKED_LINEAR
    assert machine.model_kernels([runner.model]) == {"model_linear": PACKED_LINEAR}
    runner.model.prepack(enabled=False)
    assert machine.model_kernels([runner.model]) == {"model_linear": "aten-linear"}
