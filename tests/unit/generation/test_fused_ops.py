"""The Llama layer's fused elementwise ops (csrc/fused_ops.cpp): each equal to the torch
steps it replaces (carpool.generation.llama's RMSNorm, _rotate, SiLU-and-multiply) on
every vector edge, refusing what it cannot take, and chosen by the runner where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool.generation.llama import LlamaConfig, LlamaModel, RMSNorm, _rotate
from carpool.generation.paged_decode import FUSED_OPS, UNFUSED_OPS, KernelBuild, load_kernel
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk

from .paged_driver import run_steps

ops = torch.ops.carpool


@pytest.fixture(scope="module")
def kernel_build() -> KernelBuild:
    build = load_kernel()
    assert build.is_available, build.reason
    return build


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-6)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm


# Sizes on both sides of a vector (16 floats with AVX-512, 8 with AVX2), and a model's.
SIZES = [1, 7, 15, 16, 17, 33, 100, 768]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_rms_norm_equals_the_module(kernel_build: KernelBuild, size: int, rows: int) -> None:
    x = torch.randn(rows, size, generator=torch.Generator().manual_seed(size + rows)) * 3
    norm = _norm(size, size)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x))


def test_rms_norm_adds_eps_where_it_counts(kernel_build: KernelBuild) -> None:
    # mean(x^2) about 1e-8: eps 1e-6 sets most of the scale (a misplaced eps would show)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * 1e-4
    norm = _norm(64, 3)
    for eps in (1e-6, 1e-2):
        norm.eps = eps
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, eps), norm(x))
        _, normed = ops.add_rms_norm(x, x, norm.weight, eps)
        torch.testing.assert_close(normed, norm(x + x))


@pytest.mark.parametrize("size", SIZES)
def test_add_rms_norm_equals_the_add_then_the_module(kernel_build: KernelBuild, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    x, delta = torch.randn(9, size, generator=generator), torch.randn(9, size, generator=generator)
    norm = _norm(size, size + 1)
    total, normed = ops.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)  # one float add each: the same bits
    torch.testing.assert_close(normed, norm(x + delta))


@pytest.mark.parametrize("inner", SIZES)
def test_silu_mul_equals_silu_of_gate_times_up(kernel_build: KernelBuild, inner: int) -> None:
    generator = torch.Generator().manual_seed(inner)
    gate_up = torch.randn(5, 2 * inner, generator=generator) * 8
    gate_up[0, :inner] = torch.linspace(-120.0, 120.0, inner)  # past exp's float range
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.shape == (5, inner)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [2, 6, 32, 64, 80, 128])
def test_rotary_equals_rotate_half_on_q_and_k_and_leaves_v(
    kernel_build: KernelBuild, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 11, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    half = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 500  # far positions
    angles = torch.cat((half, half), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    q, k, v = (part.clone() for part in qkv.split(split, dim=-1))
    ops.rotary_(qkv, cos, sin, heads + kv_heads, head_dim)
    got_q, got_k, got_v = qkv.split(split, dim=-1)
    for got, want, num in ((got_q, q, heads), (got_k, k, kv_heads)):
        rotated = _rotate(want.view(tokens, num, head_dim), cos, sin)
        torch.testing.assert_close(got.view(tokens, num, head_dim), rotated)
    assert torch.equal(got_v, v)


def test_rotary_rotates_rows_that_are_views_of_a_wider_tensor(kernel_build: KernelBuild) -> None:
    generator = torch.Generator().manual_seed(4)
    wide = torch.randn(7, 100, generator=generator)
    qkv = wide[:, 10:58]  # rows 48 floats long, 100 apart: 2 heads of 16 rotated, 1 not
    before = wide.clone()
    angles = torch.rand(7, 1, 16, generator=generator) * 9
    cos, sin = angles.cos(), angles.sin()
    want = _rotate(before[:, 10:42].view(7, 2, 16), cos, sin)
    ops.rotary_(qkv, cos, sin, 2, 16)
    torch.testing.assert_close(wide[:, 10:42].view(7, 2, 16), want)
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(wide[:, 42:], before[:, 42:])


def test_each_op_gives_on_two_threads_what_it_gives_on_one(kernel_build: KernelBuild) -> None:
    generator = torch.Generator().manual_seed(5)
    x, delta = (
        torch.randn(300, 256, generator=generator),
        torch.randn(300, 256, generator=generator),
    )
    weight = torch.randn(256, generator=generator)
    angles = torch.randn(300, 1, 64, generator=generator)
    runs = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            qkv = x.clone()
            ops.rotary_(qkv, angles.cos(), angles.sin(), 3, 64)
            runs.append(
                (
                    ops.rms_norm(x, weight, 1e-5),
                    *ops.add_rms_norm(x, delta, weight, 1e-5),
                    ops.silu_mul(x),
                    qkv,
                )
            )
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*runs, strict=True):
        assert torch.equal(one, two)  # each row is one thread's, in one order


def test_each_op_refuses_what_it_cannot_take_naming_it(kernel_build: KernelBuild) -> None:
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match=r"rms_norm: x must be float32 \[rows, features\]"):
        ops.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be float32 \[8\]"):
        ops.rms_norm(x, torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="x and delta must have one shape"):
        ops.add_rms_norm(x, torch.randn(3, 8), weight, 1e-6)
    with pytest.raises(RuntimeError, match=r"gate_up must be \[rows, 2 \* inner\]"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="silu_mul: gate_up must be float32"):
        ops.silu_mul(torch.randn(4))
    angles = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match=r"3 heads of 4 \(even\) must fit a row of qkv"):
        ops.rotary_(x, angles, angles, 3, 4)
    with pytest.raises(RuntimeError, match=r"cos and sin must be float32 \[2, 4\]"):
        ops.rotary_(x, torch.randn(2, 3), angles, 2, 4)
    with pytest.raises(RuntimeError, match=r"cos and sin must be float32 \[2, 4\]"):
        ops.rotary_(x, torch.randn(2, 2, 2), angles, 2, 4)  # 4 a row, not [T, D]
    with pytest.raises(RuntimeError, match="qkv's rows must be contiguous"):
        ops.rotary_(torch.randn(8, 2).t(), angles, angles, 2, 4)


# head_dim 12: the rotary's halves of 6 floats, short of any vector; 3 query heads a KV head
LLAMA = LlamaConfig(
    vocab_size=257,
    hidden_size=72,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=128,
)


def _run(
    prepack: bool, dtype: torch.dtype = torch.float32, decode_attention: str = "auto"
) -> tuple[ModelRunner, list[int], list[torch.Tensor]]:
    """A prefill of two prompts, then eight decode steps, greedy: the tokens and each
    step's logits."""
    torch.manual_seed(0)
    runner = ModelRunner(
        LlamaModel(LLAMA), 32, 16, dtype=dtype, prepack=prepack, decode_attention=decode_attention
    )
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = {1: list(range(3, 40)), 2: list(range(50, 61))}
    tables = {1: (0, 1, 2, 3), 2: (4, 5)}
    chunks = tuple(SeqChunk(i, tuple(p), 0, tables[i], True, greedy) for i, p in prompts.items())
    tokens, logits, _ = run_steps(runner, chunks, 9)
    return runner, [t for seq in tokens.values() for t in seq], logits


# The kernels' attention and torch's (SDPA over gathered blocks): both take q, k and v as
# views on the qkv rows where the ops are fused.
@pytest.mark.parametrize("decode_attention", ["kernel", "torch"])
def test_the_runner_fuses_float32_on_the_cpu_and_keeps_the_tokens(
    kernel_build: KernelBuild, decode_attention: str
) -> None:
    fused, fused_tokens, fused_logits = _run(prepack=True, decode_attention=decode_attention)
    plain, plain_tokens, plain_logits = _run(prepack=False, decode_attention=decode_attention)
    assert fused.elementwise_path == FUSED_OPS and plain.elementwise_path == UNFUSED_OPS
    assert all(layer.fused for layer in fused.model.layers)
    assert not any(layer.fused for layer in plain.model.layers)
    assert fused_tokens == plain_tokens and len(fused_tokens) == 18
    for got, want in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_other_dtypes_keep_the_torch_ops(kernel_build: KernelBuild) -> None:
    runner, tokens, _ = _run(prepack=True, dtype=torch.bfloat16)
    assert runner.elementwise_path == UNFUSED_OPS and len(tokens) == 18


def test_a_fused_model_keeps_the_torch_ops_where_gradients_are_on(
    kernel_build: KernelBuild,
) -> None:
    runner, _, _ = _run(prepack=True)
    model = runner.model
    assert isinstance(model, LlamaModel) and model.fused
    model.prepack(enabled=False)  # plain F.linear (the packed Linear has no backward either)
    hidden = torch.randn(3, LLAMA.hidden_size, requires_grad=True)
    model.compute_logits(hidden).sum().backward()  # the fused op has no backward
    assert hidden.grad is not None and float(hidden.grad.abs().sum()) > 0
