"""The Llama family on the packed batch: RMSNorm, rotary positions, grouped-query attention
over the paged KV cache, SwiGLU MLP, tied or untied LM head.

Numerics follow Hugging Face ``LlamaForCausalLM``: RMSNorm in float32 (for half
precisions), rotary angles in float32 with the ``rotate_half`` convention (the two halves
of a head, not interleaved pairs), cos/sin cast to the model dtype.

Weights are fused where Hugging Face keeps them apart: ``qkv`` is ``q_proj``, ``k_proj``,
``v_proj`` stacked by rows; ``gate_up`` is ``gate_proj`` over ``up_proj``.

In float32 on the CPU (``ModelRunner`` calls :meth:`LlamaModel.fuse`) a layer's elementwise
steps run on the extension's fused ops (``csrc/fused_ops.cpp``): RMSNorm, the residual add
with the post-attention RMSNorm, rotary positions in place on the ``qkv`` rows, and
SiLU-and-multiply, wherever gradients are off (the runner's ``inference_mode``: the ops have
no backward); the torch ops below are the path everywhere else, and the reference the
fused ops are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from carpool.generation.attention import PagedAttention
from carpool.generation.runner import FastLinear, PagedDecoder


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` that shape the model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0  # rope_type "linear": positions divided by this
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    """cos/sin of each position's rotary angles, computed per step in float32."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim = config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        # A plain attribute, not a buffer: stays float32 whatever dtype the model moves to.
        self.inv_freq = 1.0 / (config.rope_theta**exponents) / config.rope_linear_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer(nn.Module):
    fused: bool = False  # elementwise steps on carpool's fused ops (LlamaModel.fuse)

    def __init__(self, config: LlamaConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        hidden, inner = config.hidden_size, config.intermediate_size
        self.input_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv = FastLinear(hidden, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = FastLinear(q_size, hidden, bias=config.attention_bias)
        self.post_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_up = FastLinear(hidden, 2 * inner, bias=config.mlp_bias)
        self.down = FastLinear(inner, hidden, bias=config.mlp_bias)
        self.split = (q_size, kv_size, kv_size)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, ...],
        attention: PagedAttention,
    ) -> torch.Tensor:
        if self.fused and not torch.is_grad_enabled():  # the fused ops have no backward
            return self._forward_fused(x, rotary, attention)
        num_tokens = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).split(self.split, dim=-1)
        cos, sin = rotary
        q = _rotate(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        context = attention(self.index, q, k, v).reshape(num_tokens, -1)
        x = x + self.o_proj(context)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(F.silu(gate) * up)
        return out

    def _forward_fused(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, ...], attention: PagedAttention
    ) -> torch.Tensor:
        """``forward`` on the fused ops: the same steps, each one op (module docstring)."""
        ops = torch.ops.carpool
        num_tokens = x.shape[0]
        qkv = self.qkv(ops.rms_norm(x, self.input_norm.weight, self.input_norm.eps))
        cos, sin = rotary
        ops.rotary_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split(self.split, dim=-1)  # views on qkv's rows
        context = attention(
            self.index,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        ).reshape(num_tokens, -1)
        x, h = ops.add_rms_norm(x, self.o_proj(context), self.post_norm.weight, self.post_norm.eps)
        out: torch.Tensor = x + self.down(ops.silu_mul(self.gate_up(h)))
        return out


class LlamaModel(PagedDecoder):
    """``LlamaForCausalLM`` as a ``PagedDecoder``."""

    fused: bool = False  # the final norm on the fused op too (fuse)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.vocab_size = config.vocab_size
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config)
        self.layers = nn.ModuleList(LlamaLayer(config, i) for i in range(self.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = FastLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention
    ) -> torch.Tensor:
        x: torch.Tensor = self.embed(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, attention)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused and not torch.is_grad_enabled():
            normed = torch.ops.carpool.rms_norm(hidden, self.norm.weight, self.norm.eps)
        else:
            normed = self.norm(hidden)
        logits: torch.Tensor = self.lm_head(normed)
        return logits

    def fuse(self, enabled: bool) -> bool:
        """The layers' elementwise steps on the fused ops where ``enabled`` (the runner
        checked float32 on the CPU and the extension), else torch's; returns which."""
        self.fused = enabled
        for layer in self.layers:
            if isinstance(layer, LlamaLayer):
                layer.fused = enabled
        return enabled
