"""The paged GPT-2 against Hugging Face ``transformers.GPT2LMHeadModel`` on random weights
(its Conv1D weights are [in, out]: the loader transposes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from carpool.errors import ConfigError
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SeqChunk, StepInput
from carpool.generation.weights import load_model, random_gpt2, save_hf_folder

from .paged_driver import MAX_NEW, generate

CONFIG: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "initializer_range": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    hf_config = HFGPT2Config(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(hf_config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(folder: Path) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model: GPT2LMHeadModel, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
    return out[0, len(prompt) :].tolist()


def prompts_for(block_size: int) -> list[list[int]]:
    """Lengths with len % block_size in {0, 1, block_size - 1}."""
    generator = torch.Generator().manual_seed(block_size)
    lengths = [2 * block_size, 2 * block_size + 1, 3 * block_size - 1, 1]
    return [torch.randint(1, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_greedy_matches_transformers_alone_chunked_and_batched(
    folder: Path, reference: GPT2LMHeadModel, block_size: int
) -> None:
    prompts = prompts_for(block_size)
    expected = [hf_generate(reference, p) for p in prompts]
    runner = ModelRunner(load_model(folder), 64, block_size)
    assert [generate(runner, [p])[0] for p in prompts] == expected
    assert [generate(runner, [p], chunk_size=3)[0] for p in prompts] == expected
    assert generate(runner, prompts, chunk_size=3, start_steps=[0, 2, 4, 5]) == expected


def test_last_logits_close_to_transformers(folder: Path, reference: GPT2LMHeadModel) -> None:
    prompt = prompts_for(2)[1]
    runner = ModelRunner(load_model(folder), 16, 2)
    runner.compute_logits(StepInput((SeqChunk(0, tuple(prompt[:3]), 0, (9, 4), False),)))
    rest = SeqChunk(0, tuple(prompt[3:]), 3, (9, 4, 1), needs_logits=True)
    logits = runner.compute_logits(StepInput((rest,)))[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_saved_random_weights_load_into_transformers(tmp_path: Path) -> None:
    model = random_gpt2(CONFIG, seed=5)
    save_hf_folder(model, tmp_path)
    reference = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    prompt = list(range(30, 41))
    runner = ModelRunner(model, 4, 4)
    logits = runner.compute_logits(StepInput((SeqChunk(0, tuple(prompt), 0, (2, 0, 3), True),)))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_untied_head_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        random_gpt2({**CONFIG, "tie_word_embeddings": False})


def test_n_head_must_divide_n_embd() -> None:
    with pytest.raises(ConfigError, match="n_head"):
        random_gpt2({**CONFIG, "n_head": 5})
