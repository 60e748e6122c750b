"""The batch buffer pool on the CPU: allocations per batch, throughput and memory volatility
with ``buffer_pool`` on and off (issue 28).

1. allocations: ``tracemalloc`` traces collation (``ModelCall.collate``, then the split
   back) of ``--batches`` steady-state batches of W1's payloads (64 x 256 float32) and of
   the embeddings model's token arrays (packed, mixed lengths). A batch *allocated* when
   traced memory rose during its collation by at least its input's bytes (a new batch
   buffer); the table shows how many batches did, and the bytes allocated per batch.
2. throughput: W1 (``carpool.models.mlp``) and all-MiniLM-L6-v2 (packed, as the embeddings
   service runs it, texts of the corpus cut to 32 tokens) through ``carpool.Batcher`` at
   saturation (closed-loop submitters),
   pool off and on interleaved ``--repeats`` times in one process; medians and the on/off
   ratio.
3. memory volatility: (peak - trough) / peak of the process's resident memory, sampled
   after each batch by the batcher's ``memory_probe`` (the telemetry's figure), during
   the same throughput windows; medians.

    .venv/bin/python benchmarks/bench_buffer_pool.py [--repeats 5] [--window-s 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import asyncio
import statistics
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench_core import closed_loop
from benchlib import RESULTS, machine_info, utc_now, write_results
from carpool import Batcher, BatchPolicy
from carpool.core.buffer_pool import BufferPool
from carpool.core.collate import Collator, NumpyCollator, PackedCollator
from carpool.core.collate_pool import pooled
from carpool.core.model_call import Cancels, ModelCall
from carpool.core.request import Request
from carpool.models.mlp import W1_INPUT_DIM, W1Runner

DEFAULT_JSON = RESULTS / "buffer_pool.json"
W1_BATCH = 64
W1_SUBMITTERS = 256
EMBED_BATCH = 32
EMBED_SUBMITTERS = 64
EMBED_TOKENS = 32
DELAY_S = 0.002
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class RssProbe:
    """``(resident bytes, most resident bytes seen)``: volatility = (peak - trough) / peak."""

    def __init__(self) -> None:
        self.peak = 0

    def __call__(self) -> tuple[int, int]:
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * PAGE_BYTES
        self.peak = max(self.peak, rss)
        return rss, self.peak


# -- 1. allocations per batch ----------------------------------------------------------


def _requests(payloads: list[Any], collator: Collator) -> list[Request]:
    requests = []
    for payload in payloads:
        request = Request.__new__(Request)  # only what ModelCall reads of a request
        request.payload, request.is_many, request.num_items = payload, False, 1
        request.deadline_s = None
        requests.append(request)
    return requests


def allocations(
    collator: Collator, batches: list[list[Any]], model: Callable[[Any], Any], pool: bool
) -> dict[str, float]:
    """Collate and split each batch (twice over: the first pass warms the pool); traced
    on the second pass."""
    wrapped = pooled(collator, BufferPool(256 << 20) if pool else None)
    calls = [ModelCall(_requests(b, wrapped), wrapped, Cancels()) for b in batches]
    outputs = []
    for call in calls:  # warm-up: the pool fills, the model's outputs are made once
        outputs.append(model(call.collate()))
        call.output(outputs[-1], 0.0, 0.0)
    allocated = 0
    new_bytes: list[int] = []
    tracemalloc.start()
    try:
        for call, out in zip(calls, outputs, strict=True):
            call.lease = []
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            batch = call.collate()
            grown = tracemalloc.get_traced_memory()[1] - before
            call.output(out, 0.0, 0.0)
            input_bytes = _nbytes(batch)
            new_bytes.append(grown)
            allocated += grown >= input_bytes
            del batch
    finally:
        tracemalloc.stop()
    return {
        "batches": len(calls),
        "batches_that_allocated": allocated,
        "allocations_per_batch": allocated / len(calls),
        "new_bytes_per_batch_median": statistics.median(new_bytes),
    }


def _nbytes(batch: Any) -> int:
    if hasattr(batch, "data") and hasattr(batch, "lengths"):
        return int(batch.data.nbytes)
    return int(batch.nbytes)


# -- 2, 3. throughput and volatility ------------------------------------------------------


async def saturate(
    make: Callable[[bool, RssProbe], Batcher], payloads: list[Any], pool: bool, cfg: Any
) -> dict[str, float]:
    probe = RssProbe()
    async with make(pool, probe) as batcher:
        window = await closed_loop(batcher.submit, payloads, cfg.warmup_s, cfg.window_s)
        memory = batcher.snapshot().memory
        stats = batcher.buffer_pool.stats() if batcher.buffer_pool is not None else None
    return {
        "items_per_s": window.rate,
        "memory_volatility": memory.volatility if memory is not None else float("nan"),
        "pool_hits": stats.hits if stats else 0,
        "pool_misses": stats.misses if stats else 0,
    }


def w1_batcher(runner: W1Runner) -> Callable[[bool, RssProbe], Batcher]:
    def make(pool: bool, probe: RssProbe) -> Batcher:
        policy = BatchPolicy(max_batch_size=W1_BATCH, max_delay_s=DELAY_S)
        return Batcher(
            runner, policy, name="w1", collate="numpy", buffer_pool=pool, memory_probe=probe
        )

    return make


def embed_batcher(encoder: Any) -> Callable[[bool, RssProbe], Batcher]:
    def embed(batch: Any) -> np.ndarray:
        return encoder.embed_packed(batch.data, batch.lengths)  # type: ignore[no-any-return]

    def make(pool: bool, probe: RssProbe) -> Batcher:
        policy = BatchPolicy(max_batch_size=EMBED_BATCH, max_delay_s=DELAY_S)
        return Batcher(
            embed,
            policy,
            name="embed",
            collate="packed",
            buffer_pool=pool,
            memory_probe=probe,
            executor="thread",
        )

    return make


async def interleaved(
    name: str, make: Callable[[bool, RssProbe], Batcher], payloads: list[Any], cfg: Any
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for repeat in range(cfg.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for key in order:
            runs[key].append(await saturate(make, payloads, key == "on", cfg))
            last = runs[key][-1]
            print(
                f"  {name} pool {key:3}: {last['items_per_s']:9.0f} items/s, "
                f"volatility {last['memory_volatility']:.4f}"
            )
    med = {key: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for key, rs in runs.items()}
    return {
        "runs": runs,
        "median": med,
        "throughput_ratio_on_off": (
            med["on"]["items_per_s"] / med["off"]["items_per_s"]
            if med["off"]["items_per_s"]
            else float("nan")
        ),
        "volatility_on_over_off": (
            med["on"]["memory_volatility"] / med["off"]["memory_volatility"]
            if med["off"]["memory_volatility"]
            else float("nan")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--skip-embeddings", action="store_true")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    cfg = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"machine": machine_info(), "utc": utc_now(), "settings": vars(cfg)}
    print(result["machine"]["cpu_model"])

    w1_items = [rng.standard_normal(W1_INPUT_DIM, dtype=np.float32) for _ in range(W1_BATCH)]
    w1_out = np.zeros((W1_BATCH, 16), np.float32)
    w1_batches = [w1_items] * cfg.batches
    tokens: list[np.ndarray] = []
    encoder = None
    if not cfg.skip_embeddings:
        from carpool.models.embeddings import TextEncoder
        from corpus import build_corpus, model_folder

        encoder = TextEncoder.from_folder(model_folder())
        tokens = encoder.tokenize(build_corpus(512))
    else:
        lengths = rng.choice([8, 16, 24, 32, 128, 200, 256], size=512)
        tokens = [rng.integers(0, 30000, size=int(n)) for n in lengths]
    embed_batches = [tokens[i : i + EMBED_BATCH] for i in range(0, len(tokens), EMBED_BATCH)]
    embed_batches = (embed_batches * (cfg.batches // len(embed_batches) + 1))[: cfg.batches]

    print("\n[1] batches that allocated a new input buffer (tracemalloc), off -> on")
    result["allocations"] = {}
    for name, collator, batches, model in (
        ("w1", NumpyCollator(), w1_batches, lambda b: w1_out),
        ("embeddings", PackedCollator(), embed_batches, lambda b: np.zeros((b.num_items, 384))),
    ):
        pair = {key: allocations(collator, batches, model, key == "on") for key in ("off", "on")}
        result["allocations"][name] = pair
        print(
            f"  {name:10}: {pair['off']['allocations_per_batch']:.2f} -> "
            f"{pair['on']['allocations_per_batch']:.2f} per batch; new bytes per batch "
            f"{pair['off']['new_bytes_per_batch_median']:.0f} -> "
            f"{pair['on']['new_bytes_per_batch_median']:.0f}"
        )

    print(f"\n[2,3] saturation, pool off/on interleaved x{cfg.repeats}")
    w1_payloads = [
        rng.standard_normal(W1_INPUT_DIM, dtype=np.float32) for _ in range(W1_SUBMITTERS)
    ]
    result["w1"] = asyncio.run(interleaved("w1", w1_batcher(W1Runner()), w1_payloads, cfg))
    if encoder is not None:
        # Texts cut to EMBED_TOKENS: a batch computes in well under a window on a busy VM.
        embed_payloads = [tokens[i % len(tokens)][:EMBED_TOKENS] for i in range(EMBED_SUBMITTERS)]
        result["embeddings"] = asyncio.run(
            interleaved("embeddings", embed_batcher(encoder), embed_payloads, cfg)
        )
    for name in ("w1", "embeddings"):
        if name in result:
            r = result[name]
            print(
                f"  {name:10}: throughput on/off {r['throughput_ratio_on_off']:.3f}x, "
                f"volatility on/off {r['volatility_on_over_off']:.3f}"
            )
    write_results(Path(cfg.json), result)


if __name__ == "__main__":
    main()
