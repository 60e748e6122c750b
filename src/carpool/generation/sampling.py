"""Picks each request's next token from its logits: greedy, or temperature, min-p, top-k,
top-p, after the logit bias, ``min_tokens`` and penalties of ``penalties.py``; and reports
the log-probabilities a request asked for.

Every operation works row by row, so a row's token depends only on its own logits, its
``SamplingParams`` and its random draw, never on the other rows of the batch. A request
with a ``seed`` draws from its own ``torch.Generator`` (kept per ``seq_id`` until
``forget``): it samples the same tokens alone or batched with others. Requests without a
seed share one generator.

A draw is an inverse-CDF lookup: one uniform ``u`` per row, the first token whose
cumulative probability exceeds ``u`` times the row's total mass (tokens filtered out have
zero mass and are never picked).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from carpool.generation.penalties import apply_min_p, process_logits
from carpool.generation.types import SamplingParams, SeqChunk, TokenLogprobs

# Top-p alone looks at the most likely tokens first: a full sort of each row costs ~1.5 ms
# for 32 rows of 1000 on the CPU here. Rows fall back to a full sort when their top
# _TOP_P_CANDIDATES tokens hold less than top_p.
_TOP_P_CANDIDATES = 256
# Below this a temperature samples greedily, as in vLLM: logits divided by it overflow
# float32 (1e-40 gave inf and NaN, and token 0 every time).
GREEDY_BELOW = 1e-5


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Sets to ``-inf`` the logits outside each row's top-k (``k == 0``: off), then outside
    the smallest set of most likely tokens whose probability mass reaches ``top_p`` (1.0:
    off). ``logits`` [n, V]; ``top_k`` [n] int; ``top_p`` [n] float. Returns a new tensor.

    Each row's result depends on that row alone (the candidate count only changes how many
    of its sorted tokens are looked at, never the arithmetic on them)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    wanted = torch.where((top_k <= 0) & (top_p < 1.0), _TOP_P_CANDIDATES, k)
    num_candidates = min(vocab, int(wanted.max()))
    while True:
        values, order = torch.topk(logits, num_candidates, dim=-1, sorted=True)
        ranks = torch.arange(num_candidates, device=logits.device)
        is_top_k = ranks[None, :] < k[:, None]
        # Normalise over the row in its original order: the same sums whatever the count.
        kth = values.gather(1, (k.clamp(max=num_candidates) - 1)[:, None])
        threshold = torch.where(k[:, None] <= num_candidates, kth, float("-inf"))
        kept = torch.where(logits >= threshold, logits, float("-inf"))
        probs = torch.exp(values - torch.logsumexp(kept, dim=-1, keepdim=True))
        mass = torch.cumsum(torch.where(is_top_k, probs, 0.0), dim=-1)
        enough = (mass[:, -1] >= top_p) | (k <= num_candidates)
        if num_candidates == vocab or bool(enough.all()):
            break
        num_candidates = vocab
    # Keep a token while the more likely ones hold less than top_p: the first always stays.
    # top_p >= 1 is off (as in vLLM): float32 sums reach 1.0 before the tail is counted.
    is_top_p = (mass - probs < top_p[:, None]) | (ranks[None, :] == 0) | (top_p[:, None] >= 1.0)
    keep = is_top_k & is_top_p
    return torch.full_like(logits, float("-inf")).scatter(
        -1, order, torch.where(keep, values, float("-inf"))
    )


class Sampler:
    """Samples one token per row; keeps a generator per seeded ``seq_id``."""

    def __init__(self, seed: int | None = None) -> None:
        self._shared = torch.Generator()
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def has_generator(self, seq_id: int) -> bool:
        return seq_id in self._generators

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drops the generators of finished sequences."""
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def sample_chunks(
        self, logits: torch.Tensor, chunks: Sequence[SeqChunk]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """``logits`` [n, V] (row i belongs to ``chunks[i]``) -> n token ids, and for each
        row whose request asked for ``logprobs``, its token's log-probabilities (under the
        model's own logits, as vLLM reports them); None for the others."""
        params = [c.sampling for c in chunks]
        processed = process_logits(logits, chunks)
        tokens = self.sample(processed, params, [c.seq_id for c in chunks])
        return tokens, token_logprobs(logits, tokens, params)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seq_ids: Sequence[int],
    ) -> list[int]:
        """``logits`` [n, V] (row i belongs to ``seq_ids[i]``) -> n token ids."""
        tokens = [0] * len(params)
        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_BELOW]
        if greedy:
            chosen = (
                logits[greedy].argmax(dim=-1).tolist()
                if len(greedy) < len(params)
                else (logits.argmax(dim=-1).tolist())
            )
            for i, token in zip(greedy, chosen, strict=True):
                tokens[i] = token
        random_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
        filtered = [i for i in random_rows if _is_filtered(params[i])]
        plain = [i for i in random_rows if not _is_filtered(params[i])]
        for rows, is_filtered in ((filtered, True), (plain, False)):
            if rows:
                chosen = self._draw(logits, rows, params, seq_ids, is_filtered)
                for i, token in zip(rows, chosen, strict=True):
                    tokens[i] = token
        return tokens

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: Sequence[SamplingParams],
        seq_ids: Sequence[int],
        is_filtered: bool,
    ) -> list[int]:
        device = logits.device
        picked = [params[i] for i in rows]
        temperature = torch.tensor([p.temperature for p in picked], device=device)
        scaled = logits[rows].float() / temperature[:, None]
        if is_filtered:
            if any(p.min_p > 0.0 for p in picked):
                min_p = torch.tensor([p.min_p for p in picked], device=device)
                scaled = apply_min_p(scaled, min_p)
            vocab = logits.shape[-1]  # a larger top_k is all of it (and fits the tensor)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in picked):
                top_k = torch.tensor([min(p.top_k, vocab) for p in picked], device=device)
                top_p = torch.tensor([p.top_p for p in picked], device=device)
                scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1).double()
        cdf = torch.cumsum(probs, dim=-1)
        uniform = torch.cat([self._uniform(seq_ids[i], params[i]) for i in rows]).to(device)
        targets = (uniform * cdf[:, -1])[:, None]
        chosen = torch.searchsorted(cdf, targets, right=True)[:, 0]
        # u * total rounds to total at worst (the index is then past the end): fall back
        # to the last token with mass. Any other index has mass (the CDF rises there).
        past = chosen >= probs.shape[-1]
        if bool(past.any()):
            ranks = torch.arange(probs.shape[-1], device=device)
            last = torch.where(probs[past] > 0, ranks, 0).amax(dim=-1)
            chosen[past] = last
        return chosen.tolist()

    def _uniform(self, seq_id: int, params: SamplingParams) -> torch.Tensor:
        if params.seed is None:
            return torch.rand(1, generator=self._shared, dtype=torch.float64)
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator().manual_seed(params.seed)
            self._generators[seq_id] = generator
        return torch.rand(1, generator=generator, dtype=torch.float64)


def _is_filtered(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Each asking row's token log-probability and its ``logprobs`` most likely
    alternatives, from ``logits`` [n, V] in one log-softmax and one top-k."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    found: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return found
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = torch.tensor([tokens[i] for i in rows], dtype=torch.long, device=device)
    own = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    num_top = min(logits.shape[-1], max(params[i].logprobs or 0 for i in rows))
    top_values, top_ids = torch.topk(logprobs, num_top, dim=-1) if num_top else (None, None)
    for j, i in enumerate(rows):
        top: tuple[tuple[int, float], ...] = ()
        wanted = params[i].logprobs or 0
        if top_values is not None and top_ids is not None and wanted:
            pairs = zip(top_ids[j, :wanted].tolist(), top_values[j, :wanted].tolist(), strict=True)
            top = tuple(pairs)
        found[i] = TokenLogprobs(tokens[i], own[j], top)
    return found
