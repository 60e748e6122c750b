"""Logit bias, ``min_tokens``, min-p and the repetition, presence and frequency penalties,
against transformers' logits processors on the same logits, and end to end: the scheduler
and the paged runner under greedy equal ``generate`` with those processors, token for token,
with every row of the batch asking for something else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.penalties import apply_min_p, process_logits
from carpool.generation.runner import ModelRunner
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.types import SamplingParams, SeqChunk
from carpool.generation.weights import load_model

VOCAB = 120


def _chunk(history: list[int], num_prompt: int, sampling: SamplingParams) -> SeqChunk:
    """The last chunk of a sequence of ``history`` tokens (its newest one decoding)."""
    return SeqChunk(
        seq_id=0,
        token_ids=(history[-1],),
        start_pos=len(history) - 1,
        block_table=(0,),
        needs_logits=True,
        sampling=sampling,
        num_prompt_tokens=num_prompt,
        history=tuple(history) if sampling.has_penalties else (),
    )


def _inputs(rows: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB // 4, (rows, length), generator=g)  # repeats on purpose
    return ids, torch.randn(rows, VOCAB, generator=g) * 3


class _OpenAIPenalties(LogitsProcessor):  # type: ignore[misc]
    """OpenAI's presence and frequency penalties on the tokens after the prompt (transformers
    has no processor for them): the formula of OpenAI's documentation, written per token."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.num_prompt :].tolist()):
            for token in set(ids):
                scores[row, token] -= self.frequency * ids.count(token) + self.presence
        return scores


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    ids, logits = _inputs(4, 12)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    sampling = SamplingParams(repetition_penalty=penalty)
    got = process_logits(logits, [_chunk(row, 5, sampling) for row in ids.tolist()])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_presence_and_frequency_penalise_only_the_output() -> None:
    ids, logits = _inputs(3, 10, seed=1)
    expected = _OpenAIPenalties(4, 0.7, 0.4)(ids, logits)
    sampling = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4)
    got = process_logits(logits, [_chunk(row, 4, sampling) for row in ids.tolist()])
    torch.testing.assert_close(got, expected)
    prompt_only = set(ids[0, :4].tolist()) - set(ids[0, 4:].tolist())
    for token in prompt_only:
        assert got[0, token] == logits[0, token]


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    ids, logits = _inputs(2, 6, seed=2)
    bias = {5: 3.5, 17: -100.0, 60: 0.25}
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = processor(ids, logits.clone())
    sampling = SamplingParams(logit_bias=tuple(bias.items()))
    got = process_logits(logits, [_chunk(row, 6, sampling) for row in ids.tolist()])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("num_new", [0, 2, 3, 5])
def test_min_tokens_holds_back_stops_as_transformers(num_new: int) -> None:
    ids, logits = _inputs(2, 4 + num_new, seed=3)
    stops = [7, 9]
    expected = MinNewTokensLengthLogitsProcessor(4, 3, stops)(ids, logits.clone())
    sampling = SamplingParams(min_tokens=3, stop_token_ids=(7,), eos_token_ids=(9,))
    got = process_logits(logits, [_chunk(row, 4, sampling) for row in ids.tolist()])
    torch.testing.assert_close(got, expected)
    assert (got[:, stops] == float("-inf")).all() == (num_new < 3)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers(min_p: float) -> None:
    _, logits = _inputs(5, 1, seed=4)
    got = apply_min_p(logits, torch.full((5,), min_p))
    if min_p == 0.0:
        assert torch.equal(got, logits)
        return
    expected = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(got.isinf(), expected.isinf())


def test_each_row_gets_only_its_own_change() -> None:
    ids, logits = _inputs(3, 8, seed=5)
    asks = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logit_bias=((3, 2.0),)),
    ]
    chunks = [_chunk(row, 4, s) for row, s in zip(ids.tolist(), asks, strict=True)]
    got = process_logits(logits, chunks)
    alone = [process_logits(logits[i : i + 1], [chunks[i]])[0] for i in range(3)]
    torch.testing.assert_close(got, torch.stack(alone), rtol=0, atol=0)
    assert torch.equal(got[1], logits[1])
    assert process_logits(logits, [chunks[1]] * 3) is logits  # nothing asked: no copy


# -- end to end, under greedy ------------------------------------------------------------

LLAMA = LlamaConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.1, eos_token_id=3,
)  # fmt: skip
MAX_NEW = 10
EOS = 3
# Each row of one batch asks for something else; transformers' generate kwargs beside.
CASES: list[tuple[SamplingParams, dict[str, object]]] = [
    (SamplingParams(repetition_penalty=1.8), {"repetition_penalty": 1.8}),
    (SamplingParams(repetition_penalty=0.7), {"repetition_penalty": 0.7}),
    (SamplingParams(logit_bias=((11, 6.0), (12, -100.0))), {"sequence_bias": {(11,): 6.0, (12,): -100.0}}),  # noqa: E501
    (SamplingParams(min_tokens=MAX_NEW, eos_token_ids=(EOS,), logit_bias=((EOS, 20.0),)),
     {"min_new_tokens": MAX_NEW, "sequence_bias": {(EOS,): 20.0}}),
    (SamplingParams(presence_penalty=1.5, frequency_penalty=0.5), {"openai": (1.5, 0.5)}),
    (SamplingParams(), {}),
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LLAMA).eval().save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(4, VOCAB, (8,), generator=g).tolist()  # a prefix-cache hit
    return [
        shared + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (3, 5, 1, 6, 4, 2)
    ]


def _reference(folder: Path, prompt: list[int], kwargs: dict[str, object]) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    options = dict(kwargs)
    processors = LogitsProcessorList()
    if "openai" in options:
        presence, frequency = options.pop("openai")  # type: ignore[misc]
        processors.append(_OpenAIPenalties(len(prompt), presence, frequency))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
            pad_token_id=0, eos_token_id=None if "min_new_tokens" not in options else EOS,
            logits_processor=processors, **options,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_batched_greedy_with_penalties_equals_transformers(folder: Path) -> None:
    prompts = _prompts()
    runner = ModelRunner(load_model(folder), num_blocks=64, block_size=4)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=6), KVCacheManager(BlockPool(64, 4))
    )  # 7 tokens a step: chunked prefills beside decodes
    for i, (prompt, (sampling, _)) in enumerate(zip(prompts, CASES, strict=True)):
        greedy = SamplingParams(**{**_fields(sampling), "temperature": 0, "max_tokens": MAX_NEW})
        scheduler.add_request(i, prompt, greedy)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while scheduler.has_unfinished():
        result = scheduler.schedule()
        for event in scheduler.update_from_output(result, runner.execute(result.step_input)):
            outputs[event.request_id] += list(event.new_token_ids)
    for i, (prompt, (_, kwargs)) in enumerate(zip(prompts, CASES, strict=True)):
        assert outputs[i] == _reference(folder, prompt, kwargs), f"case {i}: {kwargs}"
    assert outputs[3][:MAX_NEW].count(EOS) == 0  # min_tokens beat a +20 bias on EOS


def _fields(sampling: SamplingParams) -> dict[str, object]:
    return {name: getattr(sampling, name) for name in SamplingParams.__slots__}
