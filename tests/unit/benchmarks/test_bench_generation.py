"""bench_generation's static baselines on a tiny random Llama: what each computes per step,
and that every one of them hands each request the tokens continuous batching does."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import bench_generation as bg  # noqa: E402
from carpool.generation.runner import ModelRunner  # noqa: E402
from carpool.generation.types import StepInput, StepOutput  # noqa: E402
from carpool.generation.weights import random_llama  # noqa: E402

TINY: dict[str, Any] = {**bg.MODEL_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
MAX_LEN = 48
BATCH = 4


class Counting:
    """A ModelRunner's ``execute`` that records each step's tokens and chunks."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: list[StepInput] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, step: StepInput) -> StepOutput:
        self.steps.append(step)
        return self.runner.execute(step)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.manual_seed(0)
    model = random_llama(TINY, seed=0)
    return ModelRunner(model, num_blocks=BATCH * -(-(2 * MAX_LEN) // 16) + 8, block_size=16)


@pytest.fixture(scope="module")
def workload() -> list[bg.Request]:
    return bg.build_workload(2 * BATCH, seed=3, vocab_size=TINY["vocab_size"], max_len=MAX_LEN)


def run(runner: ModelRunner, workload: list[bg.Request], **kwargs: Any) -> tuple[bg.Run, Counting]:
    counting = Counting(runner)
    batch_fn = bg.runner_batch(counting, max_len=MAX_LEN, **kwargs)  # type: ignore[arg-type]
    return bg.static_batches(workload, BATCH, batch_fn), counting


def test_classic_prefills_every_prompt_padded_to_the_batch_longest(
    runner: ModelRunner, workload: list[bg.Request]
) -> None:
    _, counting = run(runner, workload, keep_finished=True, pad_prompts=True)
    prefills = [s for s in counting.steps if any(c.start_pos == 0 for c in s.chunks)]
    batches = [workload[i : i + BATCH] for i in range(0, len(workload), BATCH)]
    assert len(prefills) == len(batches)
    for step, batch in zip(prefills, batches, strict=True):
        width = max(len(r.prompt) for r in batch)
        assert step.num_tokens == BATCH * width
        assert sum(c.needs_logits for c in step.chunks) == BATCH  # the pads sample nothing


def test_classic_forgets_its_pads_on_the_next_step(
    runner: ModelRunner, workload: list[bg.Request]
) -> None:
    _, counting = run(runner, workload[:BATCH], keep_finished=True, pad_prompts=True)
    pad_ids = {c.seq_id for c in counting.steps[0].chunks if not c.needs_logits}
    assert pad_ids, "the workload's first batch has prompts of different lengths"
    assert pad_ids <= set(counting.steps[1].finished_seq_ids)
    assert not pad_ids & {c.seq_id for s in counting.steps[1:] for c in s.chunks}


def test_padded_prefills_each_prompt_at_its_own_length(
    runner: ModelRunner, workload: list[bg.Request]
) -> None:
    _, counting = run(runner, workload[:BATCH], keep_finished=True)
    assert counting.steps[0].num_tokens == sum(len(r.prompt) for r in workload[:BATCH])


def test_every_baseline_gives_the_tokens_of_continuous_batching(
    runner: ModelRunner, workload: list[bg.Request]
) -> None:
    continuous = bg.run_continuous(runner, workload, max_num_seqs=BATCH, max_num_batched_tokens=256)
    for kwargs in ({}, {"keep_finished": True}, {"keep_finished": True, "pad_prompts": True}):
        static, _ = run(runner, workload, **kwargs)
        assert bg.agreement(continuous, static) == 1.0, kwargs
        for r in workload:
            assert len(static.traces[r.request_id].tokens) == r.output_len
