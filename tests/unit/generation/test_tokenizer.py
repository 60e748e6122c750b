"""The byte tokenizer, a Hugging Face folder (a byte-level BPE trained here, checked
against transformers on the same files) and streaming detokenization; folders as
``save_pretrained`` writes them and special tokens declared only in the config files,
each checked against ``transformers.AutoTokenizer`` on the same folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.errors import ConfigError, InvalidInput
from carpool.generation.chat import ChatMessage, render_chat
from carpool.generation.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    check_token_ids,
)

from .hf_folders import (
    LLAMA3,
    save_pretrained_folder,
    train_bpe,
    transformers_tokenizer,
    write_folder,
)
from .test_chat import _as_dicts

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
CORPUS = ["the café serves crème brûlée", "naïve señor 🚗 drives", "the the the cat sat"] * 20


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    folder = tmp_path_factory.mktemp("hf")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return folder


def _stream(tokenizer: Tokenizer, ids: list[int], prefix: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prefix or [])
    deltas = [detokenizer.push([token]) for token in ids]
    deltas.append(detokenizer.flush())
    return deltas


def test_byte_tokenizer_round_trips_utf8_with_bos():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("né🚗")
    assert ids == [256, 0x6E, 0xC3, 0xA9, 0xF0, 0x9F, 0x9A, 0x97]
    assert tokenizer.decode([*ids, ByteTokenizer.EOS_ID]) == "né🚗"
    assert tokenizer.encode("a", add_special_tokens=False) == [97]
    assert tokenizer.vocab_size == 258 and tokenizer.eos_token_ids == (257,)


def test_byte_stream_never_emits_half_a_character():
    ids = list("né 🚗!".encode())
    deltas = _stream(ByteTokenizer(), ids)
    assert "".join(deltas) == "né 🚗!"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas == ["n", "", "é", " ", "", "", "", "🚗", "!", ""]


@given(st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40))
def test_byte_stream_concatenates_to_the_text(text):
    # The text leaves out U+FFFD so that one in a delta can only be a half character.
    deltas = _stream(ByteTokenizer(), list(text.encode()), prefix=[256, *b"ctx"])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_replacement_character_in_the_text_is_held_until_the_next_one_and_never_lost():
    # A whole U+FFFD looks like a half character, so it waits for the next character or
    # the flush (vLLM's detokenizer holds it the same way); none is dropped or doubled.
    deltas = _stream(ByteTokenizer(), list("a\ufffdé\ufffd".encode()))
    assert deltas == ["a", "", "", "", "", "\ufffdé", "", "", "", "\ufffd"]


def test_a_broken_tail_is_flushed_as_a_replacement_character():
    deltas = _stream(ByteTokenizer(), [*b"ok", 0xC3])
    assert deltas == ["o", "k", "", "\ufffd"]


def test_hf_folder_reads_specials_and_template(hf_folder):
    tokenizer = HFTokenizer.from_folder(hf_folder)
    assert tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_ids == (1, 0)  # tokenizer_config's first, then config.json's
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert tokenizer.chat_template == TEMPLATE


def test_hf_folder_encodes_and_decodes_as_transformers_does(hf_folder):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(hf_folder / "tokenizer.json"))
    tokenizer = HFTokenizer.from_folder(hf_folder)
    for text in ["the café", "señor 🚗 drives brûlée"]:
        ids = tokenizer.encode(text)
        assert ids == reference(text)["input_ids"]
        assert ids[0] == 0
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text


def test_hf_stream_of_multibyte_text_matches_the_full_decode(hf_folder):
    tokenizer = HFTokenizer.from_folder(hf_folder)
    text = "señor 🚗 drives the crème brûlée café"
    prompt = tokenizer.encode("the naïve")
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids, prefix=prompt)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_hf_folder_without_tokenizer_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        HFTokenizer.from_folder(tmp_path)


def test_check_token_ids_names_the_bad_id():
    assert check_token_ids([1, 2], 10) == [1, 2]
    with pytest.raises(InvalidInput, match=r"prompt\[1\]=10: expected a token id in \[0, 10\)"):
        check_token_ids([1, 10], 10)
    with pytest.raises(InvalidInput, match=r"prompt\[0\]=True"):
        check_token_ids([True], 10)


# --- folders as save_pretrained writes them -------------------------------------------

ADVERSARIAL = [
    "Hello world",
    " leading space",
    "  two spaces",
    "tab\there\nnewline\n\n",
    "café 🚗🚗 naïve 日本語",
    "text<|eot_id|>after<|begin_of_text|>",
    "don't , . ?",
]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_folder(tmp_path_factory.mktemp("saved"))


def test_template_saved_in_chat_template_jinja_is_the_folders_template(saved_folder):
    assert not (saved_folder / "tokenizer_config.json").read_text().count("chat_template")
    reference = transformers_tokenizer(saved_folder)
    tokenizer = HFTokenizer.from_folder(saved_folder)
    assert tokenizer.chat_template == reference.chat_template == LLAMA3
    messages = [{"role": "system", "content": " Be terse. "}, {"role": "user", "content": "Hi"}]
    got = render_chat(
        _as_dicts(messages),
        tokenizer.chat_template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    assert got == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_saved_folder_encodes_decodes_and_streams_as_transformers_does(saved_folder):
    reference = transformers_tokenizer(saved_folder)
    tokenizer = HFTokenizer.from_folder(saved_folder)
    assert tokenizer.eos_token_ids == (1, 3)  # the tokenizer's, then generation_config's list
    prompt = reference.encode("the cat")
    for text in ADVERSARIAL:
        for special in (True, False):
            expected = reference.encode(text, add_special_tokens=special)
            assert tokenizer.encode(text, add_special_tokens=special) == expected, text
        ids = reference.encode(text, add_special_tokens=False)
        full = reference.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids) == full
        # Streamed next to the prompt: the deltas add up to what the prompt's text grows by.
        in_context = reference.decode(prompt + ids, skip_special_tokens=True)
        before = reference.decode(prompt, skip_special_tokens=True)
        deltas = _stream(tokenizer, ids, prefix=prompt)
        assert "".join(deltas) == in_context[len(before) :]
        assert all("\ufffd" not in d for d in deltas)


# --- special tokens declared only in the config files ---------------------------------


def test_special_tokens_map_json_names_bos_and_eos(tmp_path):
    """Older folders keep ``bos_token``/``eos_token`` in ``special_tokens_map.json``."""
    folder = write_folder(
        tmp_path,
        train_bpe(),
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3},
        special_tokens_map={
            "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "rstrip": False},
            "eos_token": "<|eot_id|>",
        },
    )
    reference = transformers_tokenizer(folder)
    tokenizer = HFTokenizer.from_folder(folder)
    assert tokenizer.bos_token == reference.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == reference.eos_token == "<|eot_id|>"
    assert tokenizer.bos_token_id == reference.bos_token_id == 0
    assert tokenizer.eos_token_ids == (reference.eos_token_id,) == (1,)
    got = render_chat(
        [ChatMessage("user", "Hi")], tokenizer.chat_template, bos_token=tokenizer.bos_token
    )
    assert got.startswith("<|begin_of_text|><|start_header_id|>user")


@pytest.mark.parametrize(
    ("with_decoder", "expected"),
    [(True, "Hello world</s>!"), (False, "Hello<|im_end|> world!")],
    ids=["added_tokens_decoder", "named"],
)
def test_tokens_special_by_the_config_are_skipped_when_decoding(tmp_path, with_decoder, expected):
    """``tokenizer.json`` may list a token as a plain added token while the config makes
    it special: an ``added_tokens_decoder`` entry, or (in a folder without one, where
    transformers reads the older way) a named special token such as ``eos_token`` (an
    ``additional_special_tokens`` entry is not enough). transformers skips it when
    decoding, and so must the text carpool streams."""
    from tokenizers import AddedToken

    bpe = train_bpe()
    bpe.add_tokens([AddedToken("<|im_end|>", special=False), AddedToken("</s>", special=False)])
    im_end, end = bpe.token_to_id("<|im_end|>"), bpe.token_to_id("</s>")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    if with_decoder:
        entry = {"content": "<|im_end|>", "special": True, "normalized": False}
        config["added_tokens_decoder"] = {str(im_end): entry}
    else:
        config["additional_special_tokens"] = ["<|im_end|>"]
    folder = write_folder(tmp_path, bpe, config)
    reference = transformers_tokenizer(folder)
    tokenizer = HFTokenizer.from_folder(folder)
    text = "Hello<|im_end|> world</s>!"
    ids = reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert im_end in ids and end in ids
    assert reference.decode(ids, skip_special_tokens=True) == expected
    assert tokenizer.decode(ids) == expected
    assert "".join(_stream(tokenizer, ids, prefix=reference.encode("the"))) == expected
    assert tokenizer.eos_token_ids == (end,)
