"""Builds decoder models from Hugging Face configs and weights, or with seeded random weights.

A Hugging Face folder holds ``config.json`` and ``model.safetensors``; ``model_type``
picks the family (``"llama"`` or ``"gpt2"``). Parameter names map to ours as each family's
``_*_sources`` table says; several Hugging Face tensors may stack into one of ours (fused
``qkv``), and GPT-2's ``Conv1D`` weights are transposed. ``save_hf_folder`` writes the
inverse, so random weights built here load into ``transformers`` for parity tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from carpool.errors import ConfigError
from carpool.generation.gpt2 import GPT2Config, GPT2Model
from carpool.generation.llama import LlamaConfig, LlamaModel
from carpool.generation.runner import PagedDecoder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class _Source:
    """The Hugging Face tensors one of our parameters is made of (stacked by rows)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...] | None = None  # rows of each part, when several
    transposed: bool = False  # a Conv1D weight: [in, out]


def _int(config: Mapping[str, Any], key: str, file: str, default: int | None = None) -> int:
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise ConfigError(key, None, "a positive integer (the key is missing)", file=file)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, value, "a positive integer", file=file)
    return value


def _float(config: Mapping[str, Any], key: str, file: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ConfigError(key, value, "a positive number", file=file)
    return float(value)


def _expect(config: Mapping[str, Any], key: str, allowed: tuple[object, ...], file: str) -> None:
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise ConfigError(key, value, " or ".join(repr(a) for a in allowed), file=file)


def llama_config(config: Mapping[str, Any], *, file: str = CONFIG_FILE) -> LlamaConfig:
    """Reads a Hugging Face Llama ``config.json`` dict; ``ConfigError`` names file and key."""
    _expect(config, "model_type", ("llama",), file)
    _expect(config, "hidden_act", ("silu",), file)
    hidden = _int(config, "hidden_size", file)
    heads = _int(config, "num_attention_heads", file)
    kv_heads = _int(config, "num_key_value_heads", file, heads)
    if heads % kv_heads:
        raise ConfigError("num_key_value_heads", kv_heads, f"a divisor of {heads}", file=file)
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ConfigError("rope_type", rope_type, "'default' or 'linear'", file=file)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=_int(config, "vocab_size", file),
        hidden_size=hidden,
        intermediate_size=_int(config, "intermediate_size", file),
        num_hidden_layers=_int(config, "num_hidden_layers", file),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_int(config, "head_dim", file, hidden // heads),
        max_position_embeddings=_int(config, "max_position_embeddings", file, 2048),
        rms_norm_eps=_float(config, "rms_norm_eps", file, 1e-6),
        rope_theta=_float({"rope_theta": theta}, "rope_theta", file, 10000.0),
        rope_linear_factor=_float(rope, "factor", file, 1.0) if rope_type == "linear" else 1.0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        initializer_range=_float(config, "initializer_range", file, 0.02),
    )


def gpt2_config(config: Mapping[str, Any], *, file: str = CONFIG_FILE) -> GPT2Config:
    """Reads a Hugging Face GPT-2 ``config.json`` dict; ``ConfigError`` names file and key."""
    _expect(config, "model_type", ("gpt2",), file)
    _expect(config, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), file)
    _expect(config, "scale_attn_weights", (True,), file)
    _expect(config, "scale_attn_by_inverse_layer_idx", (False,), file)
    _expect(config, "tie_word_embeddings", (True,), file)
    hidden = _int(config, "n_embd", file)
    heads = _int(config, "n_head", file)
    if hidden % heads:
        raise ConfigError("n_head", heads, f"a divisor of n_embd={hidden}", file=file)
    return GPT2Config(
        vocab_size=_int(config, "vocab_size", file),
        n_embd=hidden,
        n_layer=_int(config, "n_layer", file),
        n_head=heads,
        n_positions=_int(config, "n_positions", file, 1024),
        n_inner=_int(config, "n_inner", file, 4 * hidden),
        layer_norm_epsilon=_float(config, "layer_norm_epsilon", file, 1e-5),
        initializer_range=_float(config, "initializer_range", file, 0.02),
    )


def _llama_sources(config: LlamaConfig) -> dict[str, _Source]:
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    sources = {
        "embed.weight": _Source(("model.embed_tokens.weight",)),
        "norm.weight": _Source(("model.norm.weight",)),
    }
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = _Source(("lm_head.weight",))
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        sources[f"{ours}.input_norm.weight"] = _Source((f"{hf}.input_layernorm.weight",))
        sources[f"{ours}.post_norm.weight"] = _Source((f"{hf}.post_attention_layernorm.weight",))
        kinds = ["weight", "bias"] if config.attention_bias else ["weight"]
        for p in kinds:
            names = tuple(f"{hf}.self_attn.{x}_proj.{p}" for x in "qkv")
            sources[f"{ours}.qkv.{p}"] = _Source(names, (q_rows, kv_rows, kv_rows))
            sources[f"{ours}.o_proj.{p}"] = _Source((f"{hf}.self_attn.o_proj.{p}",))
        inner = config.intermediate_size
        for p in ["weight", "bias"] if config.mlp_bias else ["weight"]:
            names = (f"{hf}.mlp.gate_proj.{p}", f"{hf}.mlp.up_proj.{p}")
            sources[f"{ours}.gate_up.{p}"] = _Source(names, (inner, inner))
            sources[f"{ours}.down.{p}"] = _Source((f"{hf}.mlp.down_proj.{p}",))
    return sources


def _gpt2_sources(config: GPT2Config) -> dict[str, _Source]:
    sources = {
        f"{name}.{p}": _Source((f"transformer.{name}.{p}",))
        for name, params in (("wte", ["weight"]), ("wpe", ["weight"]), ("ln_f", ["weight", "bias"]))
        for p in params
    }
    renames = {
        "ln_1": "ln_1",
        "c_attn": "attn.c_attn",
        "attn_proj": "attn.c_proj",
        "ln_2": "ln_2",
        "c_fc": "mlp.c_fc",
        "mlp_proj": "mlp.c_proj",
    }
    for i in range(config.n_layer):
        for ours, hf in renames.items():
            for p in ("weight", "bias"):
                is_conv = p == "weight" and not ours.startswith("ln_")
                name = f"transformer.h.{i}.{hf}.{p}"
                sources[f"layers.{i}.{ours}.{p}"] = _Source((name,), transposed=is_conv)
    return sources


def _sources(model: PagedDecoder) -> dict[str, _Source]:
    if isinstance(model, LlamaModel):
        return _llama_sources(model.config)
    if isinstance(model, GPT2Model):
        return _gpt2_sources(model.config)
    raise TypeError(f"no Hugging Face name map for {type(model).__name__}")


def _lookup(tensors: Mapping[str, torch.Tensor], name: str, file: str) -> torch.Tensor:
    if name in tensors:
        return tensors[name]
    bare = name.split(".", 1)[1]  # checkpoints of the base model drop "model."/"transformer."
    if name.startswith(("model.", "transformer.")) and bare in tensors:
        return tensors[bare]
    raise ConfigError(name, None, "a tensor (the key is missing)", file=file)


def load_hf_state(
    model: PagedDecoder, tensors: Mapping[str, torch.Tensor], *, file: str = WEIGHTS_FILE
) -> None:
    """Copies Hugging Face weights into ``model``; raises ``ConfigError`` naming ``file`` and
    the key when a tensor is missing or has the wrong shape. Unused keys are ignored."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, source in _sources(model).items():
            parts = [_lookup(tensors, key, file) for key in source.names]
            if source.transposed:
                parts = [part.t() for part in parts]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if value.shape != params[name].shape:
                raise ConfigError(
                    "+".join(source.names),
                    f"a tensor of shape {list(value.shape)}",
                    f"shape {list(params[name].shape)} (from {CONFIG_FILE})",
                    file=file,
                )
            params[name].copy_(value)


def model_from_config(config: Mapping[str, Any], *, file: str = CONFIG_FILE) -> PagedDecoder:
    """An uninitialised model of the family ``config["model_type"]`` names."""
    model_type = config.get("model_type")
    if model_type == "llama":
        return LlamaModel(llama_config(config, file=file))
    if model_type == "gpt2":
        return GPT2Model(gpt2_config(config, file=file))
    raise ConfigError("model_type", model_type, "'llama' or 'gpt2'", file=file)


def load_model(folder: str | Path) -> PagedDecoder:
    """Loads a Hugging Face folder (``config.json`` + ``model.safetensors``) in float32.

    Raises ``ConfigError`` naming the file (and key) when one is missing or invalid."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ConfigError("path", str(path), "an existing file", file=str(path))
    config = json.loads(config_path.read_text())
    model = model_from_config(config, file=str(config_path))
    try:
        tensors = load_file(weights_path)
    except Exception as error:  # safetensors' own error: a cut or corrupt file
        raise ConfigError(
            WEIGHTS_FILE, None, f"a safetensors file that reads ({error})", file=str(weights_path)
        ) from None
    load_hf_state(model, tensors, file=str(weights_path))
    return model.eval()


def init_random(model: PagedDecoder, seed: int, std: float) -> None:
    """Normal(0, std) weights, zero biases, unit norms: Hugging Face's initialisation."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("ln_"):
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def random_llama(config: Mapping[str, Any], seed: int = 0) -> LlamaModel:
    """A Llama with seeded random weights, from a Hugging Face config dict."""
    model = LlamaModel(llama_config(config, file="config"))
    init_random(model, seed, model.config.initializer_range)
    return model.eval()


def random_gpt2(config: Mapping[str, Any], seed: int = 0) -> GPT2Model:
    """A GPT-2 with seeded random weights, from a Hugging Face config dict."""
    model = GPT2Model(gpt2_config(config, file="config"))
    init_random(model, seed, model.config.initializer_range)
    return model.eval()


def hf_config(model: PagedDecoder) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict that describes ``model``."""
    if isinstance(model, LlamaModel):
        c = model.config
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
        if c.rope_linear_factor != 1.0:
            rope = {**rope, "rope_type": "linear", "factor": c.rope_linear_factor}
        fields = {k: getattr(c, k) for k in c.__dataclass_fields__}
        del fields["rope_theta"], fields["rope_linear_factor"]
        extra = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu"}
        return {"model_type": "llama", **extra, **fields, "rope_parameters": rope}
    if isinstance(model, GPT2Model):
        g = model.config
        fields = {k: getattr(g, k) for k in g.__dataclass_fields__}
        extra = {"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new"}
        return {"model_type": "gpt2", **extra, **fields, "tie_word_embeddings": True}
    raise TypeError(f"no Hugging Face config for {type(model).__name__}")


def save_hf_folder(model: PagedDecoder, folder: str | Path) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` that Hugging Face ``transformers``
    (and ``load_model``) can load; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, source in _sources(model).items():
        value = params[name].detach().float().cpu()
        parts = torch.split(value, list(source.sizes)) if source.sizes else (value,)
        for key, part in zip(source.names, parts, strict=True):
            tensors[key] = (part.t() if source.transposed else part).contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config(model), indent=2))
    return folder
