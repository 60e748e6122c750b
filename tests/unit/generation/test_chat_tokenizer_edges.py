"""Chat templates and tokenizers at their edges, each checked against Hugging Face
``transformers`` (``AutoTokenizer.from_pretrained`` and ``apply_chat_template``) on the
same local folder: folders as ``save_pretrained`` writes them, special tokens declared
only in the config files, template features of real Hub templates, and the chat prompt
the server builds (one BOS, a 400 without a template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from carpool.errors import InvalidInput
from carpool.generation.chat import ChatMessage, render_chat
from carpool.generation.tokenizer import HFTokenizer, IncrementalDetokenizer

CORPUS = [
    "the café serves crème brûlée",
    "naïve señor 🚗 drives",
    "Hello world! How are you? I'm fine, don't worry.",
    "the the the cat sat",
] * 20
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]

# Llama-3's template, verbatim: BOS comes from the template, content is trimmed.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ADVERSARIAL = [
    "Hello world",
    " leading space",
    "  two spaces",
    "tab\there\nnewline\n\n",
    "café 🚗🚗 naïve 日本語",
    "text<|eot_id|>after<|begin_of_text|>",
    "don't , . ?",
]


def _bpe() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    return tokenizer


def _reference(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-like tokenizer as ``transformers``' ``save_pretrained`` writes it today:
    the template in ``chat_template.jinja``, not in ``tokenizer_config.json``."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("saved")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA3
    fast.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


def _write(folder: Path, tokenizer: Any, config: dict[str, Any], **files: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, value in files.items():
        (folder / f"{name}.json").write_text(json.dumps(value))
    return folder


def _as_dicts(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_json(m, i) for i, m in enumerate(messages)]


def _stream(tokenizer: HFTokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return [*(detokenizer.push([token]) for token in ids), detokenizer.flush()]


# --- folders as save_pretrained writes them -------------------------------------------


def test_template_saved_in_chat_template_jinja_is_the_folders_template(saved_folder):
    assert not (saved_folder / "tokenizer_config.json").read_text().count("chat_template")
    reference = _reference(saved_folder)
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
    reference = _reference(saved_folder)
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
        deltas = _stream(tokenizer, prompt, ids)
        assert "".join(deltas) == in_context[len(before) :]
        assert all("\ufffd" not in d for d in deltas)


# --- special tokens declared only in the config files ---------------------------------


def test_special_tokens_map_json_names_bos_and_eos(tmp_path):
    """Older folders keep ``bos_token``/``eos_token`` in ``special_tokens_map.json``."""
    folder = _write(
        tmp_path,
        _bpe(),
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3},
        special_tokens_map={
            "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "rstrip": False},
            "eos_token": "<|eot_id|>",
        },
    )
    reference = _reference(folder)
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

    bpe = _bpe()
    bpe.add_tokens([AddedToken("<|im_end|>", special=False), AddedToken("</s>", special=False)])
    im_end, end = bpe.token_to_id("<|im_end|>"), bpe.token_to_id("</s>")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    if with_decoder:
        entry = {"content": "<|im_end|>", "special": True, "normalized": False}
        config["added_tokens_decoder"] = {str(im_end): entry}
    else:
        config["additional_special_tokens"] = ["<|im_end|>"]
    folder = _write(tmp_path, bpe, config)
    reference = _reference(folder)
    tokenizer = HFTokenizer.from_folder(folder)
    text = "Hello<|im_end|> world</s>!"
    ids = reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert im_end in ids and end in ids
    assert reference.decode(ids, skip_special_tokens=True) == expected
    assert tokenizer.decode(ids) == expected
    assert "".join(_stream(tokenizer, reference.encode("the"), ids)) == expected
    assert tokenizer.eos_token_ids == (end,)


# --- template features of real Hub templates ------------------------------------------


def _transformers_render(template: str, messages: list[dict[str, Any]], **special: str) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, "[UNK]")),
        bos_token="<s>",
        eos_token="</s>",
        **special,
    )
    reference.chat_template = template
    return str(reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_template_can_break_out_of_a_loop():
    """``{% break %}``/``{% continue %}`` (Jinja's loopcontrols, on in transformers)."""
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }};{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    expected = _transformers_render(template, messages)
    assert expected == "a;"
    assert render_chat(_as_dicts(messages), template) == expected


def test_tojson_writes_unicode_and_markup_as_transformers_does():
    """transformers' ``tojson`` keeps non-ASCII text and ``<``/``&`` as they are (Jinja's
    own escapes them for HTML) and takes ``indent``, ``separators`` and ``sort_keys``."""
    template = (
        "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}|"
        "{{ m.content | tojson(separators=(',', ':')) }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "café <b> & 'q' 🚗"}]
    expected = _transformers_render(template, messages)
    assert "café <b> & 'q' 🚗" in expected
    assert render_chat(_as_dicts(messages), template) == expected


def test_message_name_reaches_the_template():
    template = (
        "{% for m in messages %}{% if m.name is defined %}{{ m.name }}@{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi", "name": "ana"},
    ]
    expected = _transformers_render(template, messages)
    assert "ana@user: Hi" in expected
    assert render_chat(_as_dicts(messages), template) == expected


def test_a_name_that_is_not_a_string_is_refused():
    with pytest.raises(InvalidInput, match=r"messages\[0\]\.name"):
        ChatMessage.from_json({"role": "user", "content": "x", "name": 5}, 0)


# --- the chat prompt the server builds -------------------------------------------------


def _model_folder(folder: Path, bpe: Any) -> Path:
    from carpool.generation.weights import random_llama, save_hf_folder

    config = {
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": bpe.get_vocab_size(),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 128,
    }
    return save_hf_folder(random_llama(config, seed=0), folder)


async def _chat_prompt_ids(folder: Path, messages: list[dict[str, Any]]) -> list[int]:
    from carpool.generation.build import GenerationSettings
    from carpool.server.completions import prepare
    from carpool.server.generation import GenerationService
    from carpool.server.repository import ModelRepository, ServedModel

    settings = GenerationSettings(block_size=8, num_blocks=16, max_num_seqs=1, max_model_len=64)
    service = GenerationService.from_folder("m", folder, settings)
    repository = ModelRepository([ServedModel.of_generation(service)])
    body = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 1})
    call = await prepare(repository, body, is_chat=True)
    return call.prompt_ids


async def test_chat_prompt_has_the_templates_bos_once(saved_folder, tmp_path):
    folder = _model_folder(tmp_path, _bpe())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((saved_folder / name).read_bytes())
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]
    ids = await _chat_prompt_ids(folder, messages)
    expected = _reference(folder).apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True
    )["input_ids"]
    assert ids == expected
    assert ids.count(0) == 1 and ids[0] == 0


async def test_chat_with_a_folder_without_template_is_a_400(tmp_path):
    """As vLLM (transformers >= 4.44 has no default template): a clear 400 naming
    ``messages``, not a prompt in a format the model never saw."""
    from carpool.server.openai import BadParam

    bpe = _bpe()
    folder = _model_folder(tmp_path, bpe)
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    _write(folder, bpe, config)
    with pytest.raises(BadParam, match="no chat template") as refused:
        await _chat_prompt_ids(folder, [{"role": "user", "content": "Hi"}])
    assert refused.value.param == "messages"
