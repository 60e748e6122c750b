"""A sentence-embedding model (BERT family) served from a local Hugging Face folder, packed.

``TextEncoder.from_folder`` reads what sentence-transformers writes::

    config.json                 BertConfig fields (vocab_size, hidden_size, ...)
    model.safetensors           weights; keys "bert.embeddings..." or bare "embeddings..."
    tokenizer.json              a `tokenizers` tokenizer (padding off, truncation on)
    sentence_bert_config.json   max_seq_length (else tokenizer_config.json model_max_length),
                                capped by max_position_embeddings; do_lower_case
    modules.json                Transformer, Pooling and an optional Normalize module
    1_Pooling/config.json       pooling_mode_{cls_token, max_tokens, mean_tokens,
                                mean_sqrt_len_tokens}; several are concatenated in that order

Texts are tokenized one array per text; a batch runs as one packed matrix (see
``carpool.models.bert`` for the layout and the attention variants, measured against
``embed_padded`` in docs/benchmarks.md), and pooling reduces each text's own segment of
rows: no pad token is computed or averaged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from carpool.errors import ConfigError, InvalidInput
from carpool.models import onednn
from carpool.models.bert import ATTENTION_VARIANTS, BertConfig, BertEncoder, Segments, init_random

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# sentence-transformers' Pooling order when several modes are on: their outputs concatenate.
_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
_UNSUPPORTED_POOLING = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
_MODULE_KINDS = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}


class TextEncoder:
    """Texts -> token arrays -> embeddings [n, dimensions] (float32), one packed pass per batch.

    Attributes: ``name`` (the folder's name), ``dimensions``, ``max_length`` (tokens per text
    after truncation, special tokens included), ``normalize`` (unit-length outputs),
    ``vocab_size``, ``attention`` (the variant in use, resolved from ``"auto"``).
    """

    def __init__(
        self,
        *,
        name: str,
        encoder: BertEncoder,
        tokenizer: Any | None,
        max_length: int,
        pooling: tuple[str, ...],
        normalize: bool,
        do_lower_case: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str = "auto",
        prepack: bool = True,
        quantization: str | None = None,
    ) -> None:
        self.name = name
        self.device = _device(device)
        self.dtype = _dtype(dtype)
        self.attention = _attention(attention, self.device, self.dtype)
        self.encoder = encoder.eval().to(device=self.device, dtype=self.dtype)
        self.uses_onednn = self.encoder.prepack(enabled=prepack and quantization is None)
        if quantization == "int8":
            self.encoder.quantize_int8()
        elif quantization is not None:
            raise ConfigError("quantization", quantization, "null or int8")
        self.quantization = quantization
        self.linear_kernel = (
            onednn.INT8_KERNEL if quantization else onednn.kernel_name(self.uses_onednn)
        )
        self.vocab_size = encoder.config.vocab_size
        self.max_length = max_length
        self.pooling = pooling
        self.dimensions = encoder.config.hidden_size * len(pooling)
        self.normalize = normalize
        self._tokenizer = tokenizer
        self._do_lower_case = do_lower_case

    @classmethod
    def from_folder(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str = "auto",
        prepack: bool = True,
        quantization: str | None = None,
    ) -> TextEncoder:
        """Loads a sentence-transformers (or plain Hugging Face BERT) folder.

        ``device`` is a torch device ("cpu", "cuda:0"), ``dtype`` one of float32, float16,
        bfloat16, ``attention`` "auto" or one of ``carpool.models.bert.ATTENTION_VARIANTS``;
        ``prepack`` uses oneDNN's prepacked Linear kernels where they apply (CPU; see
        ``BertEncoder.prepack``), ``uses_onednn`` says whether they do; ``quantization``
        ``"int8"`` runs the Linear layers in int8 instead (``BertEncoder.quantize_int8``:
        faster on CPUs without AVX-512, embeddings within a stated cosine of float32).
        ``linear_kernel`` names the path taken.
        Without modules.json the folder is read as a plain BERT: mean pooling, no normalization.
        Raises ``ConfigError`` naming the file and the key when something is missing or not
        supported.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError("path", str(path), "a folder holding a Hugging Face model")
        config = BertConfig.from_dict(
            _read_json(folder / "config.json"), file=str(folder / "config.json")
        )
        encoder = BertEncoder(config)
        encoder.load_hf_state(_read_weights(folder), file=str(folder / "model.safetensors"))
        pooling_dir, normalize = _read_modules(folder)
        pooling = _read_pooling(pooling_dir, config) if pooling_dir is not None else ("mean",)
        max_length, do_lower_case = _read_max_length(folder, config)
        return cls(
            name=folder.resolve().name,
            encoder=encoder,
            tokenizer=_read_tokenizer(folder, max_length),
            max_length=max_length,
            pooling=pooling,
            normalize=normalize,
            do_lower_case=do_lower_case,
            device=device,
            dtype=dtype,
            attention=attention,
            prepack=prepack,
            quantization=quantization,
        )

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        tokenizer_folder: str | Path | None = None,
        seed: int = 0,
        *,
        attention: str = "auto",
    ) -> TextEncoder:
        """A random-weight encoder (BERT init, seeded) for tests: mean pooling, normalized.

        ``config`` holds BertConfig fields; ``tokenizer_folder``, when given, supplies
        tokenizer.json and the max length; without it ``tokenize`` raises ``ConfigError``.
        """
        bert = BertConfig.from_dict(config, file="config")
        encoder = BertEncoder(bert)
        init_random(encoder, seed)
        tokenizer = None
        max_length, do_lower_case = bert.max_position_embeddings, False
        if tokenizer_folder is not None:
            folder = Path(tokenizer_folder)
            max_length, do_lower_case = _read_max_length(folder, bert)
            tokenizer = _read_tokenizer(folder, max_length)
        return cls(
            name="random-bert",
            encoder=encoder,
            tokenizer=tokenizer,
            max_length=max_length,
            pooling=("mean",),
            normalize=True,
            do_lower_case=do_lower_case,
            attention=attention,
        )

    def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One int64 array per text, with [CLS]/[SEP], truncated to ``max_length``.

        Texts are stripped (and lower-cased when do_lower_case), as sentence-transformers
        does. Thread-safe and CPU-bound: call it off the event loop. Raises ``InvalidInput``
        when ``texts`` is a str or holds a non-str.
        """
        if self._tokenizer is None:
            raise ConfigError("tokenizer_folder", None, "a folder with tokenizer.json")
        if isinstance(texts, str):
            raise InvalidInput("tokenize takes a sequence of texts, got one str")
        cleaned: list[str] = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInput(f"text {i} is a {type(text).__name__}, expected a str")
            text = text.strip()
            cleaned.append(text.lower() if self._do_lower_case else text)
        if len(cleaned) == 1:  # encode_batch wakes the tokenizers thread pool: skip it
            encodings = [self._tokenizer.encode(cleaned[0])]
        else:
            encodings = self._tokenizer.encode_batch(cleaned)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def check_token_ids(self, ids: np.ndarray) -> np.ndarray:
        """Validates one user-given token array; returns it as contiguous int64.

        Raises ``InvalidInput`` unless ``ids`` is 1-D, of an integer dtype, holds 1 to
        ``max_length`` ids, each in [0, vocab_size).
        """
        try:
            array = np.asarray(ids)
        except ValueError as exc:  # ragged nested lists
            raise InvalidInput(f"token ids must be a 1-D integer array: {exc}") from exc
        if array.dtype.kind not in "iu":
            raise InvalidInput(f"token ids must be integers, got dtype {array.dtype}")
        if array.ndim != 1:
            raise InvalidInput(f"token ids must be a 1-D array, got shape {array.shape}")
        if not 1 <= array.size <= self.max_length:
            raise InvalidInput(
                f"a text must have 1 to {self.max_length} tokens (this model's max length), "
                f"got {array.size}"
            )
        bad = np.flatnonzero((array < 0) | (array >= self.vocab_size))
        if bad.size:
            raise InvalidInput(
                f"token ids must lie in [0, {self.vocab_size}) (the vocabulary size), "
                f"got {array[bad[0]]} at position {bad[0]}"
            )
        return np.ascontiguousarray(array, dtype=np.int64)

    def embed_packed(self, input_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Embeds texts given packed: ``input_ids`` [T] concatenated, ``lengths`` [n], sum T.

        Returns float32 [n, dimensions]. Raises ``InvalidInput`` when the shapes disagree, a
        length is outside 1..max_length or an id is outside the vocabulary.
        """
        ids, lens = self._check_packed(input_ids, lengths)
        if lens.size == 0:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        cu_seqlens = np.zeros(lens.size + 1, dtype=np.int32)
        np.cumsum(lens, out=cu_seqlens[1:])
        with torch.inference_mode():
            segments = Segments.from_cu_seqlens(torch.from_numpy(cu_seqlens).to(self.device))
            hidden = self.encoder.forward_packed(
                torch.from_numpy(ids).to(self.device), segments, attention=self.attention
            )
            return self._pool(hidden, segments)

    def embed_padded(self, ids: list[np.ndarray]) -> np.ndarray:
        """Baseline for benchmarks: pads the batch to its longest text and computes every pad.

        Same weights and pooling as ``embed_packed``; returns float32 [n, dimensions].
        """
        if not ids:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        lens = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
        self._check_packed(np.concatenate(ids), lens)
        padded = np.zeros((len(ids), int(lens.max())), dtype=np.int64)
        mask = np.arange(padded.shape[1])[None, :] < lens[:, None]
        padded[mask] = np.concatenate(ids)
        cu_seqlens = np.zeros(lens.size + 1, dtype=np.int32)
        np.cumsum(lens, out=cu_seqlens[1:])
        with torch.inference_mode():
            mask_t = torch.from_numpy(mask).to(self.device)
            hidden = self.encoder.forward_padded(torch.from_numpy(padded).to(self.device), mask_t)
            segments = Segments.from_cu_seqlens(torch.from_numpy(cu_seqlens).to(self.device))
            return self._pool(hidden[mask_t], segments)  # real rows, text by text

    def __call__(self, ids: list[np.ndarray]) -> np.ndarray:
        """Packs ``ids`` (one int array per text) and runs ``embed_packed``."""
        if not ids:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
        return self.embed_packed(np.concatenate(ids), lengths)

    def _check_packed(
        self, input_ids: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        ids, lens = np.asarray(input_ids), np.asarray(lengths)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidInput(f"input_ids must be 1-D integers, got {ids.dtype} {ids.shape}")
        if lens.ndim != 1 or lens.dtype.kind not in "iu":
            raise InvalidInput(f"lengths must be 1-D integers, got {lens.dtype} {lens.shape}")
        if int(lens.sum()) != ids.size:
            raise InvalidInput(f"lengths sum to {int(lens.sum())} but there are {ids.size} ids")
        if lens.size and not (lens.min() >= 1 and lens.max() <= self.max_length):
            raise InvalidInput(
                f"each text must have 1 to {self.max_length} tokens, got lengths "
                f"{int(lens.min())}..{int(lens.max())}"
            )
        if ids.size and not (ids.min() >= 0 and ids.max() < self.vocab_size):
            raise InvalidInput(f"token ids must lie in [0, {self.vocab_size})")
        return np.ascontiguousarray(ids, dtype=np.int64), lens.astype(np.int64)

    def _pool(self, hidden: torch.Tensor, segments: Segments) -> np.ndarray:
        hidden = hidden.float()
        n, size = segments.num_texts, hidden.shape[1]
        lengths = segments.lengths.to(hidden.dtype)[:, None]
        parts: list[torch.Tensor] = []
        for mode in self.pooling:
            if mode == "cls":
                parts.append(hidden[segments.cu_seqlens[:-1].long()])
            elif mode == "max":
                index = segments.seq_ids[:, None].expand_as(hidden)
                empty = hidden.new_full((n, size), float("-inf"))
                parts.append(empty.scatter_reduce_(0, index, hidden, "amax"))
            else:
                sums = hidden.new_zeros((n, size)).index_add_(0, segments.seq_ids, hidden)
                parts.append(sums / (lengths if mode == "mean" else lengths.sqrt()))
        pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=1)
        result: np.ndarray = pooled.cpu().numpy()
        return result


def _device(device: str) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ConfigError("device", device, 'a torch device such as "cpu" or "cuda:0"') from exc


def _dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ConfigError("dtype", dtype, f"one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _attention(attention: str, device: torch.device, dtype: torch.dtype) -> str:
    if attention == "auto":
        # "loop" measured fastest on the CPU (see carpool.models.bert). On a GPU, "padded" is one
        # fused SDPA call; "varlen" (FlashAttention on cu_seqlens) is there to opt into.
        return "loop" if device.type == "cpu" else "padded"
    if attention not in ATTENTION_VARIANTS:
        raise ConfigError("attention", attention, f'"auto" or one of {list(ATTENTION_VARIANTS)}')
    if attention == "varlen" and (device.type != "cuda" or dtype == torch.float32):
        raise ConfigError(
            "attention", attention, "a CUDA device and dtype float16 or bfloat16 for varlen"
        )
    return attention


def _read_json(path: Path, *, required: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise ConfigError(path.name, None, "the file (it is missing)", file=str(path))
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(path.name, None, f"valid JSON ({exc})", file=str(path)) from exc
    if not isinstance(value, dict | list):
        raise ConfigError(path.name, value, "a JSON object", file=str(path))
    return value


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise ConfigError(
            "model.safetensors", None, "the weights file (only safetensors is read)", file=str(path)
        )
    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as error:  # safetensors' own error: a cut or corrupt file
        raise ConfigError(
            "model.safetensors", None, f"a safetensors file that reads ({error})", file=str(path)
        ) from None
    if any(key.startswith("bert.") for key in tensors):  # saved from BertFor... heads
        return {k.removeprefix("bert."): v for k, v in tensors.items() if k.startswith("bert.")}
    return tensors


def _read_modules(folder: Path) -> tuple[Path | None, bool]:
    """(the pooling folder, normalize?) from modules.json; no modules.json: plain BERT."""
    path = folder / "modules.json"
    modules = _read_json(path, required=False)
    if modules is None:
        return None, False
    if not isinstance(modules, list):
        raise ConfigError("modules.json", type(modules).__name__, "a JSON list", file=str(path))
    pooling_dir: Path | None = None
    normalize = False
    for i, module in enumerate(modules):
        kind = _MODULE_KINDS.get(str(module.get("type", "")).rsplit(".", 1)[-1])
        if kind is None:
            raise ConfigError(
                f"[{i}].type",
                module.get("type"),
                "a sentence_transformers Transformer, Pooling or Normalize module",
                file=str(path),
            )
        if kind == "pooling":
            pooling_dir = folder / str(module.get("path", ""))
        normalize = normalize or kind == "normalize"
    if pooling_dir is None:
        raise ConfigError("type", None, "a sentence_transformers Pooling module", file=str(path))
    return pooling_dir, normalize


def _read_pooling(pooling_dir: Path, config: BertConfig) -> tuple[str, ...]:
    path = pooling_dir / "config.json"
    pooling = _read_json(path)
    assert isinstance(pooling, dict)
    dimension = pooling.get("word_embedding_dimension", config.hidden_size)
    if dimension != config.hidden_size:
        raise ConfigError(
            "word_embedding_dimension",
            dimension,
            f"hidden_size={config.hidden_size}",
            file=str(path),
        )
    for key in _UNSUPPORTED_POOLING:
        if pooling.get(key):
            raise ConfigError(
                key, True, f"false; supported: {list(_POOLING_MODES)}", file=str(path)
            )
    modes = tuple(mode for key, mode in _POOLING_MODES.items() if pooling.get(key))
    if not modes:
        raise ConfigError("pooling_mode_*", None, f"one of {list(_POOLING_MODES)}", file=str(path))
    return modes


def _read_max_length(folder: Path, config: BertConfig) -> tuple[int, bool]:
    """(max tokens per text, do_lower_case), as sentence-transformers decides them."""
    st_path = folder / "sentence_bert_config.json"
    st_config = _read_json(st_path, required=False) or {}
    assert isinstance(st_config, dict)
    do_lower_case = bool(st_config.get("do_lower_case", False))
    if st_config.get("max_seq_length") is not None:
        path, key, value = st_path, "max_seq_length", st_config["max_seq_length"]
    else:
        path = folder / "tokenizer_config.json"
        tok_config = _read_json(path, required=False) or {}
        assert isinstance(tok_config, dict)
        key, value = "model_max_length", tok_config.get("model_max_length")
        if value is None:
            return config.max_position_embeddings, do_lower_case
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, value, "a positive integer", file=str(path))
    return min(int(value), config.max_position_embeddings), do_lower_case


def _read_tokenizer(folder: Path, max_length: int) -> Any:
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError("tokenizer.json", None, "the file (it is missing)", file=str(path))
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(
            "tokenizer.json", None, f"a tokenizers file ({exc})", file=str(path)
        ) from exc
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer
