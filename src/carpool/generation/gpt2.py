"""GPT-2 on the packed batch: learned positions, pre-LayerNorm blocks, ``gelu_new`` MLP,
attention over the paged KV cache, LM head tied to the token embeddings.

Hugging Face stores GPT-2's projections as ``Conv1D`` weights, [in, out]: the transpose of
an ``nn.Linear`` weight. The loader transposes them once (``weights.py``); here every
projection is a plain (fast) Linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from carpool.generation.attention import PagedAttention
from carpool.generation.runner import FastLinear, PagedDecoder


@dataclass(frozen=True, slots=True)
class GPT2Config:
    """The fields of a Hugging Face ``GPT2Config`` that shape the model."""

    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int
    n_inner: int
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02


class GPT2Layer(nn.Module):
    def __init__(self, config: GPT2Config, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        hidden, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.c_attn = FastLinear(hidden, 3 * hidden)
        self.attn_proj = FastLinear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.c_fc = FastLinear(hidden, config.n_inner)
        self.mlp_proj = FastLinear(config.n_inner, hidden)

    def forward(self, x: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        context = attention(self.index, q.reshape(shape), k.reshape(shape), v.reshape(shape))
        x = x + self.attn_proj(context.reshape(x.shape))
        inner = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")  # gelu_new
        out: torch.Tensor = x + self.mlp_proj(inner)
        return out


class GPT2Model(PagedDecoder):
    """``GPT2LMHeadModel`` as a ``PagedDecoder``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.n_layer
        self.num_kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.vocab_size = config.vocab_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.layers = nn.ModuleList(GPT2Layer(config, i) for i in range(self.num_layers))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = FastLinear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention
    ) -> torch.Tensor:
        x: torch.Tensor = self.wte(input_ids) + self.wpe(positions)
        for layer in self.layers:
            x = layer(x, attention)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return logits
