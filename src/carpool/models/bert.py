"""A BERT encoder that runs on the packed token matrix: no pad token is ever computed.

The packed layout (three texts of 3, 5 and 2 tokens, T = 10)::

    input_ids   [ a a a | b b b b b | c c ]       [T] int64, texts concatenated
    cu_seqlens  [ 0,      3,          8,    10 ]   [n + 1] int32, leading 0 (FlashAttention)
    positions   [ 0 1 2 | 0 1 2 3 4 | 0 1 ]       [T], derived from cu_seqlens, no Python loop
    hidden      [T, hidden_size]                  every Linear, LayerNorm and GELU: one matrix

Only attention needs the boundaries; ``attention=`` picks how it honours them:

- ``"loop"``: one ``scaled_dot_product_attention`` call per text, on head-major slices;
- ``"block_mask"``: one SDPA call over all T tokens with a [T, T] block-diagonal boolean mask;
  it computes and stores T² scores (most of them masked), so it only suits small T;
- ``"padded"``: pads inside attention only: scatters q/k/v into [n, L_max, ...] with a key
  padding mask, one SDPA call, gathers the real rows back; the Linear layers stay packed;
- ``"nested"``: a jagged ``torch.nested`` tensor built on the packed values and offsets; on the
  CPU, torch 2.13 unbinds it into a strided nested tensor and runs the math kernel (and warns
  "nested tensors is in prototype stage" each call);
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn``, the FlashAttention varlen kernel fed
  ``cu_seqlens`` directly; CUDA with float16/bfloat16 only (not run in this repository's tests,
  which have no GPU).

``"loop"`` is the CPU default: its cost follows the sum of L² per text, and its calls
(one per text and layer) cost little next to that. ``"block_mask"`` pays for T² scores;
``"padded"`` for n × L_max² (pads inside attention only); ``"nested"`` falls back to the
math kernel on the CPU. How each variant measured against the others and against the
padded baseline (``forward_padded``) is in docs/benchmarks.md ("BERT attention variants").
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from carpool.errors import ConfigError
from carpool.models import onednn

logger = logging.getLogger(__name__)

ATTENTION_VARIANTS = ("loop", "block_mask", "padded", "nested", "varlen")

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact erf GELU, as BERT's "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

_LINEARS = ("qkv", "attn_out", "up", "down")

# An attention function: qkv [..., 3, heads, head_dim] in, [..., heads, head_dim] out.
Attend = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of a Hugging Face ``BertConfig`` that shape the encoder."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, file: str = "config.json") -> BertConfig:
        """Reads and validates the fields; raises ``ConfigError`` naming ``file`` and the key."""
        model_type = config.get("model_type", "bert")
        if model_type != "bert":
            raise ConfigError("model_type", model_type, '"bert"', file=file)
        position_type = config.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ConfigError("position_embedding_type", position_type, '"absolute"', file=file)
        ints = {}
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            ints[key] = _positive_int(config, key, file)
        type_vocab_size = config.get("type_vocab_size", 2)
        if not isinstance(type_vocab_size, int) or type_vocab_size < 1:
            raise ConfigError("type_vocab_size", type_vocab_size, "an integer >= 1", file=file)
        hidden_act = config.get("hidden_act", "gelu")
        if hidden_act not in _ACTIVATIONS:
            raise ConfigError("hidden_act", hidden_act, f"one of {sorted(_ACTIVATIONS)}", file=file)
        eps = config.get("layer_norm_eps", 1e-12)
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not 0 < eps < 1:
            raise ConfigError("layer_norm_eps", eps, "a number in (0, 1)", file=file)
        if ints["hidden_size"] % ints["num_attention_heads"]:
            raise ConfigError(
                "num_attention_heads",
                ints["num_attention_heads"],
                f"a divisor of hidden_size={ints['hidden_size']}",
                file=file,
            )
        return cls(
            type_vocab_size=type_vocab_size,
            hidden_act=hidden_act,
            layer_norm_eps=float(eps),
            **ints,
        )


def _positive_int(config: Mapping[str, Any], key: str, file: str) -> int:
    if key not in config:
        raise ConfigError(key, None, "a positive integer (the key is missing)", file=file)
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, value, "a positive integer", file=file)
    return value


@dataclass(frozen=True, slots=True)
class Segments:
    """Where each text lies in the packed matrix; built once per batch, shared by all layers."""

    cu_seqlens: torch.Tensor  # [n + 1] int32
    lengths: torch.Tensor  # [n] int64
    seq_ids: torch.Tensor  # [T] int64: the text each token belongs to
    positions: torch.Tensor  # [T] int64: the token's position inside its text
    bounds: list[int]  # cu_seqlens as Python ints, for slicing
    max_len: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> Segments:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        starts = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - starts
        total = bounds[-1]
        num_texts = len(bounds) - 1
        device = cu_seqlens.device
        seq_ids = torch.repeat_interleave(torch.arange(num_texts, device=device), lengths)
        positions = torch.arange(total, device=device) - starts[seq_ids]
        max_len = max((e - s for s, e in itertools.pairwise(bounds)), default=0)
        return cls(cu_seqlens, lengths, seq_ids, positions, bounds, max_len)

    @property
    def num_texts(self) -> int:
        return len(self.bounds) - 1


def _attend_loop(seg: Segments) -> Attend:
    pairs = list(itertools.pairwise(seg.bounds))

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        # Head-major [3, heads, T, D]: each text's slice is contiguous per head.
        # 4-D slices [1, heads, L, D]: SDPA takes its fused CPU kernel (3-D ones fall back
        # to the slower math path; docs/benchmarks.md).
        q, k, v = qkv.permute(1, 2, 0, 3).contiguous()[:, None].unbind(0)
        out = torch.empty_like(q)
        for s, e in pairs:
            out[:, :, s:e] = F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
            )
        return out[0].transpose(0, 1)

    return attend


def _attend_block_mask(seg: Segments) -> Attend:
    mask = seg.seq_ids[:, None] == seg.seq_ids[None, :]  # [T, T]: True inside a text

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.permute(1, 2, 0, 3).unbind(0)  # [heads, T, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)

    return attend


def _attend_padded(seg: Segments) -> Attend:
    n, max_len = seg.num_texts, seg.max_len
    flat = seg.seq_ids * max_len + seg.positions  # row of each token in [n * L_max]
    key_mask = (torch.arange(max_len, device=flat.device)[None, :] < seg.lengths[:, None])[
        :, None, None, :
    ]  # [n, 1, 1, L_max]

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        padded = qkv.new_zeros((n * max_len, *qkv.shape[1:]))
        padded.index_copy_(0, flat, qkv)
        q, k, v = padded.view(n, max_len, *qkv.shape[1:]).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [n, h, L, D]
        return out.transpose(1, 2).reshape(n * max_len, *qkv.shape[2:]).index_select(0, flat)

    return attend


def _attend_nested(seg: Segments) -> Attend:
    offsets = seg.cu_seqlens.long()

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets=offsets).transpose(1, 2)
            for t in qkv.unbind(1)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # [n, heads, j, D]
        values: torch.Tensor = out.transpose(1, 2).values()
        return values

    return attend


def _attend_varlen(seg: Segments) -> Attend:
    from torch.nn.attention.varlen import varlen_attn

    cu = seg.cu_seqlens

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unbind(1)
        out = varlen_attn(q, k, v, cu, cu, seg.max_len, seg.max_len)
        assert isinstance(out, torch.Tensor)
        return out

    return attend


_PACKED_ATTENTION: dict[str, Callable[[Segments], Attend]] = {
    "loop": _attend_loop,
    "block_mask": _attend_block_mask,
    "padded": _attend_padded,
    "nested": _attend_nested,
    "varlen": _attend_varlen,
}


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        out: torch.Tensor = self.norm(x)
        return out


class _Layer(nn.Module):
    """One encoder layer; shape-agnostic ([T, H] packed or [n, L, H] padded) but for ``attend``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // config.num_attention_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key and value fused in one matmul
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up = nn.Linear(hidden, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

        self.fuses_gelu = config.hidden_act == "gelu"
        self.packed: dict[str, torch.Tensor] = {}  # oneDNN-prepacked weights (see prepack)
        self.quantized: dict[str, onednn.Int8Weight] = {}  # int8 weights (see quantize_int8)

    def prepack(self) -> None:
        """Reorder the Linear weights for oneDNN once, so every batch skips the reorder."""
        self.packed = {name: onednn.reorder_weight(getattr(self, name).weight) for name in _LINEARS}

    def quantize_int8(self) -> None:
        """Quantize the Linear weights to int8 once (per output channel)."""
        self.quantized = {
            name: onednn.quantize_weight(getattr(self, name).weight) for name in _LINEARS
        }

    def _linear(self, name: str, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        module: nn.Linear = getattr(self, name)
        packed = self.packed.get(name)
        if packed is not None:
            return onednn.linear(x, packed, module.bias, gelu=gelu)
        quantized = self.quantized.get(name)
        out: torch.Tensor = (
            module(x) if quantized is None else onednn.int8_linear(x, quantized, module.bias)
        )
        return self.act(out) if gelu else out

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        lead = x.shape[:-1]
        qkv = self._linear("qkv", x).view(*lead, 3, self.num_heads, self.head_dim)
        context = attend(qkv).reshape(*lead, -1)
        x = self.attn_norm(x + self._linear("attn_out", context))
        if self.fuses_gelu and self.packed:
            up = self._linear("up", x, gelu=True)
        else:
            up = self.act(self._linear("up", x))
        out: torch.Tensor = self.out_norm(x + self._linear("down", up))
        return out


class BertEncoder(nn.Module):
    """Embeddings and encoder layers of BERT; returns the last hidden states."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))

    def prepack(self, enabled: bool = True) -> bool:
        """Use oneDNN's prepacked Linear kernels where this CPU and dtype support them (see
        :mod:`carpool.models.onednn`); returns whether they are used
        (``enabled=False`` drops any prepacked weights). Elsewhere (a GPU, a
        dtype this CPU cannot prepack) the layers keep ``nn.Linear``. Call again after
        moving the module to another device or dtype. Drops int8 weights: call
        :meth:`quantize_int8` instead for an int8 model."""
        layers = self._layers()
        weight = layers[0].qkv.weight if layers else None
        usable = enabled and weight is not None and onednn.can_prepack(weight.dtype, weight.device)
        for layer in layers:
            layer.quantized = {}
            if usable:
                layer.prepack()
            else:
                layer.packed = {}
        logger.debug("BertEncoder Linear layers: %s", onednn.kernel_name(usable))
        return usable

    def quantize_int8(self) -> None:
        """Run every Linear layer in int8 (:func:`carpool.models.onednn.int8_linear`:
        weights per channel, activations per token, so batch-invariant); float32 on the CPU
        only. Drops prepacked weights.

        Raises:
            ConfigError: on field ``quantization`` when the model is not float32 on the CPU
                or this torch build has no CPU int8 product.
        """
        layers = self._layers()
        weight = layers[0].qkv.weight if layers else None
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            where = "no layers" if weight is None else f"{weight.dtype} on {weight.device}"
            raise ConfigError("quantization", "int8", f"a float32 model on the CPU, not {where}")
        if not onednn.can_int8():
            raise ConfigError(
                "quantization",
                "int8",
                f"a torch build with a CPU int8 matmul ({torch.__version__})",
            )
        for layer in layers:
            layer.packed = {}
            layer.quantize_int8()
        logger.debug("BertEncoder Linear layers: %s", onednn.INT8_KERNEL)

    def _layers(self) -> list[_Layer]:
        return list(self.layers)  # type: ignore[arg-type]

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        segments: Segments,
        token_type_ids: torch.Tensor | None = None,
        *,
        attention: str = "loop",
    ) -> torch.Tensor:
        """``input_ids`` [T] (texts concatenated, as ``segments`` says) -> hidden [T, H]."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        attend = _PACKED_ATTENTION[attention](segments)
        x: torch.Tensor = self.embeddings(input_ids, segments.positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, attend)
        return x

    def forward_padded(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The usual padded path: ``input_ids`` [n, L], bool mask [n, L] -> hidden [n, L, H]."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        key_mask = attention_mask[:, None, None, :]

        def attend(qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [n, heads, L, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
            return out.transpose(1, 2)

        x: torch.Tensor = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, attend)
        return x

    def load_hf_state(self, tensors: Mapping[str, torch.Tensor], *, file: str) -> None:
        """Copies Hugging Face ``BertModel`` weights (keys without the ``bert.`` prefix) in.

        Raises ``ConfigError`` naming ``file`` and the key when a tensor is missing or has the
        wrong shape; keys it does not use (pooler, heads, ``position_ids``) are ignored.
        """
        own = self.state_dict()
        mapped: dict[str, torch.Tensor] = {}
        for name, hf_names in _hf_names(self.config).items():
            parts = [_hf_tensor(tensors, key, file) for key in hf_names]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if value.shape != own[name].shape:
                raise ConfigError(
                    "+".join(hf_names),
                    f"a tensor of shape {list(value.shape)}",
                    f"shape {list(own[name].shape)} (from config.json)",
                    file=file,
                )
            mapped[name] = value
        self.load_state_dict(mapped, strict=True)


def _hf_tensor(tensors: Mapping[str, torch.Tensor], key: str, file: str) -> torch.Tensor:
    if key not in tensors:
        raise ConfigError(key, None, "a tensor (the key is missing)", file=file)
    return tensors[key]


def _hf_names(config: BertConfig) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face names it is made of (several: concatenated)."""
    names = {
        "embeddings.word.weight": ["embeddings.word_embeddings.weight"],
        "embeddings.position.weight": ["embeddings.position_embeddings.weight"],
        "embeddings.token_type.weight": ["embeddings.token_type_embeddings.weight"],
        "embeddings.norm.weight": ["embeddings.LayerNorm.weight"],
        "embeddings.norm.bias": ["embeddings.LayerNorm.bias"],
    }
    for i in range(config.num_hidden_layers):
        hf = f"encoder.layer.{i}"
        ours = f"layers.{i}"
        for p in ("weight", "bias"):
            names[f"{ours}.qkv.{p}"] = [
                f"{hf}.attention.self.{part}.{p}" for part in ("query", "key", "value")
            ]
            names[f"{ours}.attn_out.{p}"] = [f"{hf}.attention.output.dense.{p}"]
            names[f"{ours}.attn_norm.{p}"] = [f"{hf}.attention.output.LayerNorm.{p}"]
            names[f"{ours}.up.{p}"] = [f"{hf}.intermediate.dense.{p}"]
            names[f"{ours}.down.{p}"] = [f"{hf}.output.dense.{p}"]
            names[f"{ours}.out_norm.{p}"] = [f"{hf}.output.LayerNorm.{p}"]
    return names


def init_random(encoder: BertEncoder, seed: int) -> None:
    """BERT's initialisation (normal(0, 0.02) weights, zero biases, unit norms), seeded."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
