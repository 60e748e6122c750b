"""Greedy, temperature, top-k and top-p sampling; seeded requests are batch-independent."""

from __future__ import annotations

import pytest
import torch

from carpool.generation.sampling import Sampler, apply_top_k_top_p
from carpool.generation.types import SamplingParams


def _logits(rows: int = 6, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _kept_by_sorting(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The reference: sort, cut at k, keep the smallest prefix with mass >= top_p."""
    order = torch.argsort(row, descending=True)
    if top_k:
        order = order[:top_k]
    probs = torch.softmax(row[order].double(), dim=0)
    count = int((torch.cumsum(probs, 0) < top_p).sum()) + 1
    return set(order[: min(count, len(order))].tolist())


def test_greedy_is_argmax() -> None:
    logits = _logits()
    tokens = Sampler(0).sample(logits, [SamplingParams(temperature=0)] * 6, list(range(6)))
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(6)]
    assert Sampler(0).sample(logits, params, list(range(6))) == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = _logits(rows=4, vocab=1000)
    logits[3] = torch.randn(1000) * 0.01  # nearly flat: more than 256 candidates needed
    cases = [(0, 0.5), (0, 0.9), (20, 0.7), (0, 0.95)]
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases])
    filtered = apply_top_k_top_p(logits, top_k, top_p)
    for row, (k, p) in enumerate(cases):
        kept = set(torch.nonzero(filtered[row] > float("-inf"))[:, 0].tolist())
        assert kept == _kept_by_sorting(logits[row], k, p)
        assert torch.equal(filtered[row][list(kept)], logits[row][list(kept)])
    assert len(set(torch.nonzero(filtered[3] > float("-inf"))[:, 0].tolist())) > 256


def test_filtering_a_row_does_not_depend_on_its_neighbours() -> None:
    logits = _logits(rows=3, vocab=1000)
    logits[2] = torch.randn(1000) * 0.01  # forces the full sort for the whole batch
    k, p = torch.tensor([0, 0, 0]), torch.tensor([0.8, 0.6, 0.9])
    batched = apply_top_k_top_p(logits, k, p)
    alone = apply_top_k_top_p(logits[:1], k[:1], p[:1])
    assert torch.equal(batched[:1], alone)


def test_sampled_tokens_respect_top_k() -> None:
    logits = _logits(rows=1)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler(0)
    for seq_id in range(50):
        params = SamplingParams(temperature=5.0, top_k=3)
        assert sampler.sample(logits, [params], [seq_id])[0] in allowed


def test_seeded_request_samples_the_same_alone_and_batched() -> None:
    logits = _logits(rows=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), seeded]
    alone_sampler, batch_sampler = Sampler(1), Sampler(2)
    alone, batched = [], []
    for _ in range(10):
        alone += alone_sampler.sample(logits[2:3], [seeded], [7])
        batched.append(
            batch_sampler.sample(logits[:4], [*others[:2], seeded, others[2]], [1, 2, 7, 8])[2]
        )
    assert alone == batched


def test_unseeded_sampling_differs_across_sampler_seeds() -> None:
    logits = torch.zeros(8, 100)  # uniform: every token equally likely
    params = [SamplingParams(temperature=1.0)] * 8
    draws = {tuple(Sampler(seed).sample(logits, params, list(range(8)))) for seed in range(4)}
    assert len(draws) > 1


def test_forget_drops_the_generator() -> None:
    sampler = Sampler(0)
    params = SamplingParams(temperature=1.0, seed=3)
    first = sampler.sample(_logits(rows=1), [params], [9])
    assert sampler.has_generator(9)
    sampler.forget([9])
    assert not sampler.has_generator(9)
    assert sampler.sample(_logits(rows=1), [params], [9]) == first  # a fresh generator


@pytest.mark.parametrize("top_k", [0, 40, 64])
def test_top_p_of_one_filters_nothing(top_k: int) -> None:
    # Tail probabilities below float32's resolution next to 1.0: top_p=1.0 is "off" in
    # vLLM, so every token of the top-k (all of them for top_k=0) keeps its chance.
    logits = torch.linspace(0.0, -30.0, 64)[None, :]
    filtered = apply_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([1.0]))
    assert int(torch.isfinite(filtered).sum()) == (top_k or 64)


def test_a_draw_at_the_very_end_of_the_cdf_takes_the_last_token_with_mass(monkeypatch) -> None:
    """u * total can round up to total: searchsorted then points past the vocabulary."""
    sampler = Sampler(seed=0)
    monkeypatch.setattr(sampler, "_uniform", lambda *_: torch.ones(1, dtype=torch.float64))
    logits = torch.zeros(2, 10)
    logits[0, 7:] = float("-inf")  # row 0: tokens 7-9 have no mass
    params = [SamplingParams(temperature=1.0)] * 2
    assert sampler.sample(logits, params, [0, 1]) == [6, 9]
