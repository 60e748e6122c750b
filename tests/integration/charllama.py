"""A random-weight Llama folder with a character-level tokenizer, for the tests that serve
generation from a config (test_generation_fault_mix.py, test_cuda_generation_serving.py):
every token but EOS is one character, so the text a client sees says how many tokens were
generated (the EOS ``~`` is an ordinary character, so with ``ignore_eos`` it shows as one)."""

from __future__ import annotations

from pathlib import Path

import orjson

EOS = "~"
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def char_llama_folder(folder: Path, max_model_len: int) -> Path:
    """A random-weight Llama (peaked logits: large initial weights) with a character-level
    tokenizer: printable ASCII and newline, ``~`` the EOS; no BOS, no special tokens (a
    token that shows no text would hide from the count)."""
    from tokenizers import Tokenizer, decoders, models

    from carpool.generation.weights import random_llama, save_hf_folder

    vocab = {c: i for i, c in enumerate(CHARS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    config = {
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": len(vocab),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_model_len,
        "initializer_range": 0.3,
    }
    save_hf_folder(random_llama(config, seed=3), folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    # An empty table of added tokens: EOS is an ordinary character, not skipped in text.
    special = {"eos_token": EOS, "chat_template": TEMPLATE, "added_tokens_decoder": {}}
    (folder / "tokenizer_config.json").write_text(orjson.dumps(special).decode())
    return folder
