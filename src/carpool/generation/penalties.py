"""What changes a batch's logits before a token is picked: logit bias, ``min_tokens``,
and vLLM's repetition, presence and frequency penalties, each a few tensor ops over the
rows that ask for it (rows that do not are never touched or copied).

The order is vLLM's: bias and ``min_tokens`` first, then the penalties::

    logits[r, t] += bias[r, t]                                  logit_bias
    logits[r, stop] = -inf      while r has < min_tokens out    stop_token_ids and EOS
    seen:     logits / p if logits > 0 else logits * p          repetition (prompt + output)
    logits -= frequency * count_out[r, t] + presence * (count_out[r, t] > 0)   (output)

Repetition is transformers' ``RepetitionPenaltyLogitsProcessor`` on the whole sequence;
presence and frequency are OpenAI's formula on the generated tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from carpool.generation.types import SamplingParams, SeqChunk


def process_logits(logits: torch.Tensor, chunks: Sequence[SeqChunk]) -> torch.Tensor:
    """``logits`` [n, V] float32, row i sampling for ``chunks[i]``: the logits to sample
    from. Returns ``logits`` itself when no row asks for a change, else a changed copy."""
    params = [c.sampling for c in chunks]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    held = [i for i, c in enumerate(chunks) if _num_output(c) < c.sampling.min_tokens]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if not (biased or held or penalised):
        return logits
    logits = logits.clone()
    if biased:
        _add_bias(logits, biased, params)
    if held:
        _hold_stops(logits, held, params)
    if penalised:
        apply_penalties(
            logits,
            penalised,
            [chunks[i].history for i in penalised],
            [chunks[i].num_prompt_tokens for i in penalised],
            [params[i] for i in penalised],
        )
    return logits


def _num_output(chunk: SeqChunk) -> int:
    return chunk.start_pos + len(chunk.token_ids) - chunk.num_prompt_tokens


def _add_bias(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    pairs = [(i, token, bias) for i in rows for token, bias in params[i].logit_bias]
    index = torch.tensor([(i, t) for i, t, _ in pairs], dtype=torch.long, device=logits.device)
    values = torch.tensor([b for _, _, b in pairs], dtype=logits.dtype, device=logits.device)
    logits.index_put_((index[:, 0], index[:, 1]), values, accumulate=True)


def _hold_stops(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    pairs = [
        (i, token) for i in rows for token in {*params[i].stop_token_ids, *params[i].eos_token_ids}
    ]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=logits.device)
        logits[index[:, 0], index[:, 1]] = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    histories: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    params: Sequence[SamplingParams],
) -> None:
    """Penalises ``logits[rows]`` in place: row ``rows[j]`` has the tokens
    ``histories[j]``, of which the first ``num_prompt_tokens[j]`` are its prompt.

    Only the (row, token) pairs a history holds are read and written, never a whole
    [rows, V] matrix: a sequence holds far fewer distinct tokens than the vocabulary."""
    device, vocab = logits.device, logits.shape[-1]
    lengths = torch.tensor([len(h) for h in histories])
    tokens = torch.tensor([t for history in histories for t in history], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(rows)), lengths)  # j of each token
    first = torch.cumsum(lengths, 0) - lengths
    is_output = torch.arange(len(tokens)) - first[owner] >= torch.tensor(num_prompt_tokens)[owner]
    keys = (torch.tensor(rows)[owner] * vocab + tokens).to(device)  # row * V + token

    def per_row(values: list[float]) -> torch.Tensor:  # indexed by the logits' row
        full = torch.zeros(logits.shape[0], dtype=logits.dtype)
        full[rows] = torch.tensor(values, dtype=logits.dtype)
        return full.to(device)

    repetition = per_row([p.repetition_penalty for p in params])
    seen = torch.unique(keys)
    row, token = seen // vocab, seen % vocab
    picked = logits[row, token]
    factor = repetition[row]
    logits[row, token] = torch.where(picked > 0, picked / factor, picked * factor)
    output, counts = torch.unique(keys[is_output.to(device)], return_counts=True)
    if len(output):
        row, token = output // vocab, output % vocab
        frequency = per_row([p.frequency_penalty for p in params])[row]
        presence = per_row([p.presence_penalty for p in params])[row]
        logits[row, token] -= frequency * counts.to(logits.dtype) + presence


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Sets to ``-inf`` the tokens less likely than ``min_p`` times the row's most likely
    one (``min_p`` [n]; 0: off), as transformers' ``MinPLogitsWarper``. ``logits`` are
    already divided by the temperature. Returns a new tensor."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return torch.where(probs < threshold, float("-inf"), logits)
