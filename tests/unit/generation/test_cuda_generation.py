"""The generation runner on a CUDA GPU against the same runner on the CPU: greedy tokens and
logits, chunked prefill over cached blocks, seeded sampling with penalties, half precision,
the paths it names where the CPU's kernels cannot run, and the continuous-batching loop over
the real scheduler.

These need a GPU that torch can use and are skipped anywhere else (CI has none). Their last
run on one is recorded in docs/benchmarks.md, "Generation on a GPU".
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from carpool.errors import ConfigError
from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.llama import LlamaConfig, LlamaModel
from carpool.generation.paged_decode import UNFUSED_OPS
from carpool.generation.runner import ModelRunner
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.types import SamplingParams, SeqChunk
from carpool.models import onednn

from .paged_driver import run_steps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none here"
)

LLAMA = LlamaConfig(
    vocab_size=263,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
BLOCK_SIZE = 8
NUM_BLOCKS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
# Worst absolute logit error, as a share of the largest CPU logit: float32 differs only in
# summation order; float16 and bfloat16 keep 11 and 8 bits of each value.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
PROMPTS = {1: list(range(3, 44)), 2: list(range(50, 61)), 3: [7, 9]}
TABLES = {1: tuple(range(0, 8)), 2: tuple(range(20, 26)), 3: tuple(range(40, 46))}


def _runner(device: str, dtype: torch.dtype = torch.float32, **kwargs: object) -> ModelRunner:
    torch.manual_seed(0)  # the same weights on both devices
    return ModelRunner(LlamaModel(LLAMA), NUM_BLOCKS, BLOCK_SIZE, device, dtype, **kwargs)  # type: ignore[arg-type]


def _generate(
    runner: ModelRunner,
    params: SamplingParams = GREEDY,
    steps: int = 10,
    reference: ModelRunner | None = None,
) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Prompt 1 prefilled in two chunks (the second over its cached blocks) while prompts
    2 and 3 prefill whole, then decode steps (``run_steps``): each sequence's tokens, each
    step's logits, and ``reference``'s on the same chunks."""
    chunks = tuple(
        SeqChunk(i, tuple(p[:20] if i == 1 else p), 0, TABLES[i], i != 1, params, len(p),
                 tuple(p))
        for i, p in PROMPTS.items()
    )  # fmt: skip
    tokens, logits, reference_logits = run_steps(
        runner, chunks, steps, rests={1: tuple(PROMPTS[1][20:])}, reference=reference
    )
    return [tokens[i] for i in PROMPTS], logits, reference_logits


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[dtype] * scale)


def test_greedy_tokens_and_logits_on_the_gpu_are_the_cpus() -> None:
    cpu_tokens, cpu_logits, _ = _generate(_runner("cpu"))
    gpu_tokens, gpu_logits, _ = _generate(_runner("cuda:0"))
    assert gpu_tokens == cpu_tokens
    assert [len(t) for t in gpu_tokens] == [9, 10, 10]
    for got, want in zip(gpu_logits, cpu_logits, strict=True):
        _close(got, want, torch.float32)


def test_the_gpu_runner_names_the_torch_paths_it_runs() -> None:
    runner = _runner("cuda:0")
    assert runner.kv_cache.device.type == "cuda"
    assert runner.decode_attention_path == "torch"
    assert runner.linear_path == onednn.kernel_name(False)
    assert runner.elementwise_path == UNFUSED_OPS
    assert runner.huge_pages == "off: cuda memory"
    assert all(p.device.type == "cuda" for p in runner.model.parameters())


def test_the_cpu_kernel_asked_for_on_the_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="decode_attention") as raised:
        _runner("cuda:0", decode_attention="kernel")
    assert "on the CPU" in str(raised.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_on_the_gpu_keeps_every_steps_logits_within_its_bits(
    dtype: torch.dtype,
) -> None:
    """Every step (the chunked prefill over cached blocks and the decodes) on the same
    chunks: the GPU in ``dtype`` against the CPU in float32."""
    runner = _runner("cuda:0", dtype)
    assert runner.kv_cache.dtype == dtype
    tokens, gpu_logits, cpu_logits = _generate(runner, steps=6, reference=_runner("cpu"))
    assert [len(t) for t in tokens] == [5, 6, 6]
    for got, want in zip(gpu_logits, cpu_logits, strict=True):
        _close(got, want, dtype)


def test_seeded_sampling_with_penalties_and_bias_draws_the_cpus_tokens() -> None:
    params = SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        seed=11,
        max_tokens=64,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        logit_bias=((5, 2.0), (17, -50.0)),
    )
    cpu_tokens, _, _ = _generate(_runner("cpu"), params)
    gpu_tokens, _, _ = _generate(_runner("cuda:0"), params)
    assert gpu_tokens == cpu_tokens
    assert not any(17 in seq for seq in gpu_tokens)  # biased away


def _continuous(runner: ModelRunner) -> dict[int, list[int]]:
    """Eight requests of spread lengths through the real scheduler and ``runner``: at most
    four sequences and 24 tokens a step, so prompts are chunked and requests wait."""
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4), KVCacheManager(pool)
    )
    for i in range(8):
        prompt = tuple((7 * i + 3 * j) % LLAMA.vocab_size for j in range(5 + 9 * i))
        scheduler.add_request(i, prompt, replace(GREEDY, max_tokens=4 + 3 * i))
    tokens: dict[int, list[int]] = {i: [] for i in range(8)}
    while scheduler.has_unfinished():
        result = scheduler.schedule()
        output = runner.execute(result.step_input)
        for event in scheduler.update_from_output(result, output):
            tokens[event.request_id].extend(event.new_token_ids)
    pool.check_invariants()
    return tokens


def test_continuous_batching_on_the_gpu_answers_as_on_the_cpu() -> None:
    gpu = _continuous(_runner("cuda:0"))
    assert gpu == _continuous(_runner("cpu"))
    assert [len(gpu[i]) for i in range(8)] == [4 + 3 * i for i in range(8)]
