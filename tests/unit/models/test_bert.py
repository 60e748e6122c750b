"""The packed BERT encoder against Hugging Face ``transformers.BertModel`` on random weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import BertConfig as HFBertConfig
from transformers import BertModel

from carpool.errors import ConfigError
from carpool.models.bert import BertConfig, BertEncoder, Segments, init_random

NESTED_WARNING = pytest.mark.filterwarnings(
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning"
)
TINY: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "hidden_act": "gelu",
    "max_position_embeddings": 40,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}
LENGTHS = [1, 7, 30, 2, 40, 13]


@pytest.fixture(scope="module")
def reference() -> BertModel:
    torch.manual_seed(0)
    return BertModel(HFBertConfig(**TINY), add_pooling_layer=False).eval()


@pytest.fixture(scope="module")
def encoder(reference: BertModel) -> BertEncoder:
    encoder = BertEncoder(BertConfig.from_dict(TINY)).eval()
    encoder.load_hf_state(reference.state_dict(), file="state_dict")
    return encoder


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor, Segments]:
    """(packed ids [T], padded ids [n, L_max], segments)."""
    generator = torch.Generator().manual_seed(1)
    texts = [torch.randint(1, 100, (n,), generator=generator) for n in LENGTHS]
    padded = torch.nn.utils.rnn.pad_sequence(texts, batch_first=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(texts), padded, Segments.from_cu_seqlens(cu_seqlens)


def _mask() -> torch.Tensor:
    return torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]


def test_segments_give_per_text_positions() -> None:
    segments = Segments.from_cu_seqlens(torch.tensor([0, 3, 8, 10], dtype=torch.int32))
    assert segments.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert segments.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    assert segments.lengths.tolist() == [3, 5, 2]
    assert segments.max_len == 5
    assert segments.num_texts == 3


@pytest.mark.parametrize(
    "attention",
    ["loop", "block_mask", "padded", pytest.param("nested", marks=NESTED_WARNING)],
)
def test_packed_matches_transformers_on_real_tokens(
    attention: str,
    encoder: BertEncoder,
    reference: BertModel,
    batch: tuple[torch.Tensor, torch.Tensor, Segments],
) -> None:
    packed_ids, padded_ids, segments = batch
    with torch.inference_mode():
        want = reference(input_ids=padded_ids, attention_mask=_mask().long()).last_hidden_state
        got = encoder.forward_packed(packed_ids, segments, attention=attention)
    torch.testing.assert_close(got, want[_mask()], atol=1e-5, rtol=1e-5)


def test_padded_matches_transformers(
    encoder: BertEncoder, reference: BertModel, batch: tuple[torch.Tensor, torch.Tensor, Segments]
) -> None:
    _, padded_ids, _ = batch
    token_types = (torch.arange(padded_ids.shape[1]) % 2).expand_as(padded_ids)
    with torch.inference_mode():
        want = reference(
            input_ids=padded_ids, attention_mask=_mask().long(), token_type_ids=token_types
        ).last_hidden_state
        got = encoder.forward_padded(padded_ids, _mask(), token_types)
    torch.testing.assert_close(got[_mask()], want[_mask()], atol=1e-5, rtol=1e-5)


def test_missing_or_misshapen_weight_names_the_key(reference: BertModel) -> None:
    state = dict(reference.state_dict())
    encoder = BertEncoder(BertConfig.from_dict(TINY))
    state["encoder.layer.1.output.dense.bias"] = torch.zeros(5)
    with pytest.raises(ConfigError, match=r"w\.st: invalid encoder\.layer\.1\.output\.dense\.bias"):
        encoder.load_hf_state(state, file="w.st")
    del state["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ConfigError, match="key is missing"):
        encoder.load_hf_state(state, file="w.st")


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"num_attention_heads": 5}, "num_attention_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_act": "swish"}, "hidden_act"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"layer_norm_eps": "small"}, "layer_norm_eps"),
    ],
)
def test_config_errors_name_the_field(edit: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        BertConfig.from_dict(TINY | edit, file="cfg.json")
    assert info.value.field == field
    assert info.value.file == "cfg.json"


def test_init_random_is_seeded() -> None:
    first, second = (BertEncoder(BertConfig.from_dict(TINY)) for _ in range(2))
    init_random(first, seed=3)
    init_random(second, seed=3)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a, b)
