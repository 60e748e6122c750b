"""Hugging Face tokenizer folders for the tests that check carpool against ``transformers``
on the same files: a byte-level BPE trained here, with Llama-3's special tokens, written as
``save_pretrained`` writes it or file by file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def train_bpe() -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) of 400 ids, SPECIALS first, that puts
    ``<|begin_of_text|>`` before what it encodes."""
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


def transformers_tokenizer(folder: Path) -> Any:
    """The reference: what ``transformers`` reads from ``folder``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def save_pretrained_folder(folder: Path) -> Path:
    """A Llama-3-like tokenizer as ``transformers``' ``save_pretrained`` writes it today:
    the template in ``chat_template.jinja``, not in ``tokenizer_config.json``; the EOS ids
    of ``generation_config.json`` are 1 and 3."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA3
    fast.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return folder


def write_folder(folder: Path, tokenizer: Any, config: dict[str, Any], **files: Any) -> Path:
    """``tokenizer.json``, ``tokenizer_config.json`` (``config``) and, for each keyword, a
    JSON file of that name in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, value in files.items():
        (folder / f"{name}.json").write_text(json.dumps(value))
    return folder
