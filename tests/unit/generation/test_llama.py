"""The paged Llama against Hugging Face ``transformers.LlamaForCausalLM`` on random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from carpool.errors import ConfigError
from carpool.generation.attention import group_by_length
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SeqChunk, StepInput
from carpool.generation.weights import load_model, random_llama, save_hf_folder

from .paged_driver import MAX_NEW, generate

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 128,
    "initializer_range": 0.1,  # larger than the default: greedy outputs vary more
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    hf_config = HFLlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    reference = LlamaForCausalLM(hf_config).eval()
    path = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(folder: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=0
        )
    return out[0, len(prompt) :].tolist()


def prompts_for(block_size: int) -> list[list[int]]:
    """Lengths with len % block_size in {0, 1, block_size - 1}."""
    generator = torch.Generator().manual_seed(block_size)
    lengths = [2 * block_size, 2 * block_size + 1, 3 * block_size - 1, 1]
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_greedy_matches_transformers_alone_chunked_and_batched(
    folder: Path, reference: LlamaForCausalLM, block_size: int
) -> None:
    prompts = prompts_for(block_size)
    expected = [hf_generate(reference, p) for p in prompts]
    runner = ModelRunner(load_model(folder), 64, block_size)
    alone = [generate(runner, [p])[0] for p in prompts]
    chunked = [generate(runner, [p], chunk_size=3)[0] for p in prompts]
    # Staggered: while one sequence prefills in chunks, the others decode.
    batched = generate(runner, prompts, chunk_size=3, start_steps=[0, 2, 4, 5])
    assert alone == expected
    assert chunked == expected
    assert batched == expected


def test_greedy_matches_transformers_with_widely_spread_lengths_in_one_step(
    folder: Path, reference: LlamaForCausalLM
) -> None:
    # Contexts from 2 to 116 tokens decode in the same steps, in 3 or more length groups.
    lengths = [1, 2, 9, 31, 60, 61, 110]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]
    assert len(group_by_length([n + 1 for n in lengths])) >= 3
    runner = ModelRunner(load_model(folder), 128, 4)
    assert generate(runner, prompts) == [hf_generate(reference, p) for p in prompts]


def test_greedy_matches_transformers_on_a_long_prompt_prefilled_over_many_chunks(
    folder: Path, reference: LlamaForCausalLM
) -> None:
    # 117 tokens in chunks of 25 over blocks of 4: each chunk after the first attends over a
    # cached prefix of several blocks, ending mid-block; a short prompt decodes alongside.
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (117, 30)]
    runner = ModelRunner(load_model(folder), 96, 4)
    outputs = generate(runner, prompts, chunk_size=25, start_steps=[0, 1])
    assert outputs == [hf_generate(reference, p) for p in prompts]


def test_last_logits_close_to_transformers(folder: Path, reference: LlamaForCausalLM) -> None:
    prompt = prompts_for(3)[1]
    runner = ModelRunner(load_model(folder), 16, 3)
    first = SeqChunk(0, tuple(prompt[:4]), 0, (5, 2, 7), needs_logits=False)
    runner.compute_logits(StepInput((first,)))
    rest = SeqChunk(0, tuple(prompt[4:]), 4, (5, 2, 7), needs_logits=True)
    logits = runner.compute_logits(StepInput((rest,)))[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_prepacked_linear_layers_match_plain_ones(folder: Path) -> None:
    prompt = tuple(prompts_for(16)[0])
    results = []
    for prepack in (True, False):
        runner = ModelRunner(load_model(folder), 4, 16, prepack=prepack)
        chunk = SeqChunk(0, prompt, 0, (0, 1, 2), needs_logits=True)
        results.append(runner.compute_logits(StepInput((chunk,))))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_saved_random_weights_load_into_transformers(tmp_path: Path) -> None:
    model = random_llama({**CONFIG, "tie_word_embeddings": True}, seed=3)
    save_hf_folder(model, tmp_path)
    reference = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    prompt = list(range(10, 20))
    runner = ModelRunner(model, 4, 8)
    chunk = SeqChunk(0, tuple(prompt), 0, (3, 1), needs_logits=True)
    logits = runner.compute_logits(StepInput((chunk,)))[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_random_weights_are_seeded() -> None:
    a, b, c = (random_llama(CONFIG, seed=s).embed.weight for s in (1, 1, 2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_missing_config_key_names_file_and_key(folder: Path, tmp_path: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=r"config\.json: invalid hidden_size=None"):
        load_model(tmp_path)


def test_missing_tensor_names_file_and_key(tmp_path: Path) -> None:
    save_hf_folder(random_llama(CONFIG), tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.safetensors: .*layers\.1\.self_attn\.k_proj"):
        load_model(tmp_path)


def test_a_corrupt_weights_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """Was: safetensors' own error out of `carpool serve`, a traceback and exit 1."""
    save_hf_folder(random_llama(CONFIG), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(bytes(100))
    with pytest.raises(ConfigError, match=r"model\.safetensors: .*a safetensors file that reads"):
        load_model(tmp_path)


def test_unsupported_rope_type_is_a_config_error() -> None:
    config = {**CONFIG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}
    with pytest.raises(ConfigError, match="rope_type"):
        random_llama(config)
