"""Generation on one CPU thread: continuous batching vs static batching vs HF ``generate``.

A random-weight Llama (``--model small``: hidden 256, 4 layers, 8 heads, 2 KV heads,
intermediate 688, vocab 2000; ``--model 88m``: hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 8000; seed 0) serves one fixed-seed workload: prompt and output
lengths each log-uniform in [16, ``--max-len``] (default 512; most short, some long),
random prompt tokens, greedy, EOS ignored so every request generates exactly its output
length. Systems, on the same weights:

    continuous  carpool's Scheduler + KVCacheManager + BlockPool + ModelRunner in a step loop
    static      the same ModelRunner, batches of up to B in arrival order; a batch starts when
                the previous one has finished entirely and runs until its longest member is
                done (finished members leave the steps, the batch is held): idealised static
    padded      padded static batching on the same runner: as static, but finished
                members keep their slots and keep computing (their tokens thrown away) until
                the batch ends, as ``generate`` does; each prompt is prefilled at its own length
    classic     classic padded static batching on the same runner, as ``generate`` runs a
                batch: as padded, and each prompt is also padded (on the left) to the batch's
                longest prompt, the pad tokens computed in the prefill step like real ones.
                The runner has no attention mask, so the pads run as a separate throwaway
                sequence per member (same matmul work, attention over themselves only), and
                decode steps do not attend over them as ``generate``'s masked pads are: the
                pads cost this baseline less than they cost ``generate``
    hf          transformers' LlamaForCausalLM.generate, left-padded batches of up to B,
                min_new_tokens = max_new_tokens = the batch's longest output, same static
                manner (only each request's own tokens count as useful output)

B is ``--static-batch-size`` (default: the continuous scheduler's ``max_num_seqs``). The KV
pool holds what B sequences padded to the longest prompt + output would need, so with
``--max-num-seqs 128 --static-batch-size 32`` both systems get the same KV memory and paged
continuous batching uses it for more sequences (what the paged cache is for). A static
batch takes the requests that have arrived when it starts (up to B; at least the next one,
waited for if none has).
Arrival patterns: every request at t=0, and Poisson at ``--rate-rps``. Every loop runs in
real time: requests are handed to a system once their arrival time has passed (before each
step, or before each batch for static/hf); the loop sleeps only when it has nothing to do.

Per system and pattern: requests/s (completed / makespan), useful output tokens/s, TTFT
(arrival to the first output token), inter-token latency (gaps between a request's
successive tokens), end-to-end latency (arrival to the last token; for hf, to the return of
``generate``, which hands back the whole batch at once). static and hf do not stream: their
token times are the end of the batch step that computed the token (for hf, recorded by a
stopping criterion that ``generate`` calls after every step), so their ITL is the batch's
step time and their TTFT is the earliest a streaming server could have sent the token.
Also the step overhead of continuous batching: over steps where exactly 32 sequences decode,
the time outside the model (schedule + execute + update - ``model_time_s``) as a share of
the step (schedule + execute + update).

Every system is warmed up on a few short requests first; each (system, pattern) is one
timed run (no repeats: a full run takes ~6-8 minutes), so the figures are single runs and
the ratios compare runs made one after another in the same process.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_generation.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchlib import RESULTS, machine_info, serving_malloc, utc_now, write_results
from carpool.generation.block_pool import BlockPool
from carpool.generation.kv_cache import KVCacheManager
from carpool.generation.runner import ModelRunner
from carpool.generation.scheduler import Scheduler, SchedulerConfig
from carpool.generation.types import SamplingParams, SeqChunk, StepInput
from carpool.generation.weights import random_llama, save_hf_folder

DEFAULT_JSON = RESULTS / "generation.json"
MODELS: dict[str, dict[str, Any]] = {}
MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 2000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
MODELS["small"] = MODEL_CONFIG
MODELS["88m"] = {**MODEL_CONFIG, "vocab_size": 8000, "hidden_size": 768,
                 "intermediate_size": 2048, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "num_key_value_heads": 4}  # fmt: skip
MODEL_SEED = 0
WORKLOAD_SEED = 0
MIN_LEN, MAX_LEN = 16, 512
BLOCK_SIZE = 16
OVERHEAD_BATCH = 32
SYSTEMS = ("continuous", "static", "padded", "classic", "hf")
BASELINES = ("static", "padded", "classic", "hf")
PATTERNS = ("all-at-once", "poisson")
LABELS = {"continuous": "carpool continuous", "static": "static (ModelRunner)",
          "padded": "padded static", "classic": "classic padded static",
          "hf": "HF generate"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Request:
    request_id: int
    prompt: tuple[int, ...]
    output_len: int
    arrival_s: float  # offset from the start of the run


@dataclass(slots=True)
class Trace:
    """What one request saw: the times its tokens were produced, and when it completed."""

    token_times_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done_s: float = math.nan


@dataclass(slots=True)
class StepTiming:
    num_decode: int
    num_prefill: int
    step_s: float  # schedule + execute + update
    model_s: float


@dataclass(slots=True)
class Run:
    traces: dict[int, Trace]
    makespan_s: float
    num_steps: int  # model forward passes (generate steps for hf)
    steps: list[StepTiming] = field(default_factory=list)


# -- the workload ------------------------------------------------------------------------


def log_uniform(rng: np.random.Generator, n: int, max_len: int = MAX_LEN) -> np.ndarray:
    """``n`` integers log-uniform in [MIN_LEN, max_len]."""
    return np.rint(np.exp(rng.uniform(math.log(MIN_LEN), math.log(max_len), n))).astype(int)


def build_workload(
    num_requests: int, seed: int, vocab_size: int, max_len: int = MAX_LEN
) -> list[Request]:
    """Prompts and output lengths, arrival offsets all 0 (see :func:`with_arrivals`)."""
    rng = np.random.default_rng(seed)
    prompt_lens = log_uniform(rng, num_requests, max_len)
    output_lens = log_uniform(rng, num_requests, max_len)
    return [
        Request(i, tuple(rng.integers(1, vocab_size, int(p)).tolist()), int(o), 0.0)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True))
    ]


def with_arrivals(
    workload: list[Request], pattern: str, rate_rps: float, seed: int
) -> list[Request]:
    """The same requests, arriving all at t=0 or as a Poisson process (first at t=0)."""
    if pattern == "all-at-once":
        return workload
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate_rps, len(workload))
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return [
        Request(r.request_id, r.prompt, r.output_len, float(a))
        for r, a in zip(workload, arrivals, strict=True)
    ]


def sleep_until(t_s: float) -> None:
    delay = t_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# -- (a) continuous batching -------------------------------------------------------------


def run_continuous(
    runner: ModelRunner, requests: list[Request], max_num_seqs: int, max_num_batched_tokens: int
) -> Run:
    """The real scheduler and runner in a real-time step loop."""
    pool = BlockPool(runner.num_blocks, runner.block_size)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        KVCacheManager(pool),
    )
    traces = {r.request_id: Trace() for r in requests}
    steps: list[StepTiming] = []
    clock = time.perf_counter
    num_added = num_done = 0
    t0 = clock()
    while num_done < len(requests):
        now = clock() - t0
        while num_added < len(requests) and requests[num_added].arrival_s <= now:
            r = requests[num_added]
            sampling = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            scheduler.add_request(r.request_id, r.prompt, sampling, arrival_s=r.arrival_s)
            num_added += 1
        if not scheduler.has_unfinished():
            sleep_until(t0 + requests[num_added].arrival_s)
            continue
        started = clock()
        result = scheduler.schedule()
        output = runner.execute(result.step_input)
        events = scheduler.update_from_output(result, output)
        ended = clock()
        steps.append(
            StepTiming(
                result.num_decode_tokens,
                result.num_prefill_tokens,
                ended - started,
                output.model_time_s,
            )
        )
        for event in events:
            trace = traces[event.request_id]
            trace.tokens.extend(event.new_token_ids)
            trace.token_times_s.extend([ended - t0] * len(event.new_token_ids))
            if event.is_finished:
                trace.done_s = ended - t0
                num_done += 1
    pool.check_invariants()
    return Run(traces, clock() - t0, len(steps), steps)


# -- (b) static batching on the same runner ----------------------------------------------


def static_batches(
    requests: list[Request],
    max_batch: int,
    run_batch: Callable[[list[Request], float, dict[int, Trace]], int],
) -> Run:
    """Batches of up to ``max_batch`` arrived requests, in arrival order, one after another."""
    traces = {r.request_id: Trace() for r in requests}
    t0 = time.perf_counter()
    next_index = num_steps = 0
    while next_index < len(requests):
        sleep_until(t0 + requests[next_index].arrival_s)  # at least the next one
        now = time.perf_counter() - t0
        end = next_index
        while end < len(requests) and end - next_index < max_batch:
            if requests[end].arrival_s > now:
                break
            end += 1
        num_steps += run_batch(requests[next_index:end], t0, traces)
        next_index = end
    return Run(traces, time.perf_counter() - t0, num_steps)


def runner_batch(
    runner: ModelRunner,
    keep_finished: bool = False,
    max_len: int = MAX_LEN,
    pad_prompts: bool = False,
) -> Callable[[list[Request], float, dict[int, Trace]], int]:
    """One static batch on ``runner``: one prefill step, then decode steps of the members
    still short of their output length (``keep_finished``: of every member, the finished
    ones' tokens thrown away), until the longest is done. ``pad_prompts``: the prefill step
    also computes, per member, pad tokens up to the batch's longest prompt (a throwaway
    sequence written to the second half of the member's blocks, which its prompt never
    reaches, and forgotten after that step)."""
    blocks_per_seq = -(-(2 * max_len) // runner.block_size)
    half = blocks_per_seq // 2
    pad_ids = 1 << 40  # above every request id

    def run_batch(batch: list[Request], t0: float, traces: dict[int, Trace]) -> int:
        tables = {
            r.request_id: tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            for i, r in enumerate(batch)
        }
        sampling = {
            r.request_id: SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            for r in batch
        }
        chunks = tuple(
            SeqChunk(r.request_id, r.prompt, 0, tables[r.request_id], True, sampling[r.request_id])
            for r in batch
        )
        pads: list[int] = []
        if pad_prompts:
            width = max(len(r.prompt) for r in batch)
            pad_chunks = tuple(
                SeqChunk(pad_ids + r.request_id, (0,) * (width - len(r.prompt)), 0,
                         tables[r.request_id][half:], False)
                for r in batch
                if len(r.prompt) < width
            )  # fmt: skip
            pads = [c.seq_id for c in pad_chunks]
            chunks += pad_chunks
        forget: tuple[int, ...] = ()
        members = list(batch)
        made: dict[int, list[int]] = {r.request_id: [] for r in batch}  # thrown away too
        done: set[int] = set()
        finished: list[int] = []
        num_steps = 0
        while len(done) < len(batch):
            num_steps += 1
            output = runner.execute(StepInput(chunks, tuple(finished) + forget))
            forget, pads = tuple(pads), []  # the next step forgets the pads it no longer runs
            now = time.perf_counter() - t0
            finished = []
            sampled = output.sampled[: len(members)]  # the pads' chunks come last
            assert all(t is None for t in output.sampled[len(members) :])
            for r, token_id in zip(members, sampled, strict=True):
                assert token_id is not None
                made[r.request_id].append(token_id)
                trace = traces[r.request_id]
                if r.request_id in done:
                    continue
                trace.tokens.append(token_id)
                trace.token_times_s.append(now)
                if len(trace.tokens) == r.output_len:
                    trace.done_s = now
                    done.add(r.request_id)
                    finished.append(r.request_id)
            if not keep_finished:
                members = [r for r in members if r.request_id not in done]
            chunks = tuple(
                SeqChunk(
                    r.request_id,
                    (made[r.request_id][-1],),
                    len(r.prompt) + len(made[r.request_id]) - 1,
                    tables[r.request_id],
                    True,
                    sampling[r.request_id],
                )
                for r in members
            )
        runner.execute(StepInput((), tuple(made) + forget))  # the runner forgets them all
        return num_steps

    return run_batch


# -- (c) Hugging Face generate -----------------------------------------------------------


def hf_batch(model: Any) -> Callable[[list[Request], float, dict[int, Trace]], int]:
    """One left-padded ``generate`` call per batch, to the batch's longest output."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):  # type: ignore[misc]
        """Records when each step's tokens exist; never stops anything."""

        def __init__(self) -> None:
            self.times_s: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.times_s.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run_batch(batch: list[Request], t0: float, traces: dict[int, Trace]) -> int:
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        num_new = max(r.output_len for r in batch)
        step_clock = StepClock()
        with torch.inference_mode():
            out = model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([step_clock]),
            )
        done = time.perf_counter() - t0
        assert len(step_clock.times_s) == num_new, (len(step_clock.times_s), num_new)
        for row, r in enumerate(batch):
            trace = traces[r.request_id]
            trace.tokens = out[row, width : width + r.output_len].tolist()
            trace.token_times_s = [t - t0 for t in step_clock.times_s[: r.output_len]]
            trace.done_s = done  # generate hands back the whole batch at once
        return num_new

    return run_batch


# -- figures -----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(run: Run, requests: list[Request]) -> dict[str, Any]:
    ttft, itl, e2e = [], [], []
    num_tokens = 0
    for r in requests:
        trace = run.traces[r.request_id]
        assert len(trace.tokens) == r.output_len, (r.request_id, len(trace.tokens), r.output_len)
        num_tokens += r.output_len
        ttft.append(trace.token_times_s[0] - r.arrival_s)
        itl.extend(np.diff(trace.token_times_s).tolist())
        e2e.append(trace.done_s - r.arrival_s)
    ms = 1e3
    return {
        "num_requests": len(requests),
        "num_output_tokens": num_tokens,
        "makespan_s": run.makespan_s,
        "requests_per_s": len(requests) / run.makespan_s,
        "output_tokens_per_s": num_tokens / run.makespan_s,
        "ttft_p50_ms": pct(ttft, 50) * ms,
        "ttft_p99_ms": pct(ttft, 99) * ms,
        "itl_p50_ms": pct(itl, 50) * ms,
        "itl_p99_ms": pct(itl, 99) * ms,
        "e2e_p50_ms": pct(e2e, 50) * ms,
        "e2e_p99_ms": pct(e2e, 99) * ms,
        "num_steps": run.num_steps,
        "output_tokens_per_step": num_tokens / run.num_steps,
    }


def step_overhead(steps: list[StepTiming], batch: int) -> dict[str, Any]:
    """Time outside the model as a share of the step, over steps of exactly ``batch``
    decodes and no prefill."""
    chosen = [s for s in steps if s.num_decode == batch and s.num_prefill == 0]
    if not chosen:
        return {"batch": batch, "num_steps": 0}
    shares = [(s.step_s - s.model_s) / s.step_s for s in chosen]
    total = sum(s.step_s for s in chosen)
    return {
        "batch": batch,
        "num_steps": len(chosen),
        "share_median": statistics.median(shares),
        "share_of_total": (total - sum(s.model_s for s in chosen)) / total,
        "step_median_ms": statistics.median(s.step_s for s in chosen) * 1e3,
        "outside_median_ms": statistics.median(s.step_s - s.model_s for s in chosen) * 1e3,
    }


def agreement(a: Run, b: Run) -> float:
    """The share of requests whose greedy outputs are identical in both runs."""
    same = sum(a.traces[i].tokens == b.traces[i].tokens for i in a.traces)
    return same / len(a.traces)


def table(rows: list[dict[str, Any]]) -> str:
    columns = [
        ("req/s", "requests_per_s", "7.2f"),
        ("tok/s", "output_tokens_per_s", "7.0f"),
        ("TTFT p50", "ttft_p50_ms", "9.0f"),
        ("TTFT p99", "ttft_p99_ms", "9.0f"),
        ("ITL p50", "itl_p50_ms", "8.1f"),
        ("ITL p99", "itl_p99_ms", "8.1f"),
        ("E2E p50", "e2e_p50_ms", "8.0f"),
        ("E2E p99", "e2e_p99_ms", "8.0f"),
        ("span s", "makespan_s", "7.1f"),
        ("steps", "num_steps", "6d"),
        ("tok/step", "output_tokens_per_step", "8.1f"),
    ]
    header = f"{'pattern':12} {'system':21}" + "".join(
        f" {t:>{int(s.split('.')[0].rstrip('d'))}}" for t, _, s in columns
    )
    lines = [header, "(latencies in ms)"]
    for row in rows:
        cells = "".join(f" {format(row[k], s)}" for _, k, s in columns)
        lines.append(f"{row['pattern']:12} {LABELS[row['system']]:21}{cells}")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    by = {(r["pattern"], r["system"]): r for r in rows}
    out: dict[str, dict[str, float]] = {}
    for pattern in PATTERNS:
        cont = by.get((pattern, "continuous"))
        if cont is None:
            continue
        for base in BASELINES:
            other = by.get((pattern, base))
            if other is None:
                continue
            out[f"{pattern}/continuous_vs_{base}"] = {
                "throughput": cont["output_tokens_per_s"] / other["output_tokens_per_s"],
                "requests_per_s": cont["requests_per_s"] / other["requests_per_s"],
                "ttft_p50": other["ttft_p50_ms"] / cont["ttft_p50_ms"],
                "ttft_p99": other["ttft_p99_ms"] / cont["ttft_p99_ms"],
                "e2e_p50": other["e2e_p50_ms"] / cont["e2e_p50_ms"],
            }
    return out


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--rate-rps", type=float, default=5.0, help="Poisson arrival rate")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--static-batch-size",
        type=int,
        default=None,
        help="B of static/hf (default: --max-num-seqs); the KV pool holds what B padded "
        "sequences of the longest prompt + output would need, so both get the same memory",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--max-len", type=int, default=MAX_LEN, help="longest prompt/output")
    parser.add_argument("--device", default="cpu", help="where every system runs: cpu, cuda:0")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    model_config = MODELS[args.model]
    chosen: dict[str, list[str]] = {}  # flag -> the names asked, in the known order
    for flag, given, known in (("--systems", args.systems, SYSTEMS),
                               ("--patterns", args.patterns, PATTERNS)):  # fmt: skip
        asked = set(given.split(","))
        if unknown := sorted(asked - set(known)):
            parser.error(f"{flag}: unknown {', '.join(unknown)}; expected names from "
                         f"{','.join(known)}")  # fmt: skip
        chosen[flag] = [name for name in known if name in asked]
    systems, patterns = chosen["--systems"], chosen["--patterns"]

    torch.set_num_threads(1)
    torch.manual_seed(0)
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA GPU here")

    malloc = serving_malloc()
    machine = machine_info(
        malloc=malloc,
        transformers=transformers.__version__,
        torch_threads=torch.get_num_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        cpu_affinity=sorted(os.sched_getaffinity(0)),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    )
    print("machine:", machine, flush=True)

    workload = build_workload(
        args.num_requests, WORKLOAD_SEED, model_config["vocab_size"], args.max_len
    )
    prompt_lens = [len(r.prompt) for r in workload]
    output_lens = [r.output_len for r in workload]
    workload_info = {
        "seed": WORKLOAD_SEED,
        "num_requests": len(workload),
        "length_distribution": f"log-uniform integers in [{MIN_LEN}, {args.max_len}]",
        "prompt_tokens_mean": statistics.mean(prompt_lens),
        "prompt_tokens_median": statistics.median(prompt_lens),
        "prompt_tokens_max": max(prompt_lens),
        "output_tokens_mean": statistics.mean(output_lens),
        "output_tokens_median": statistics.median(output_lens),
        "output_tokens_max": max(output_lens),
        "output_tokens_total": sum(output_lens),
        "poisson_rate_rps": args.rate_rps,
        "greedy": True,
        "ignore_eos": True,
    }
    print("workload:", workload_info, flush=True)

    model = random_llama(model_config, seed=MODEL_SEED)
    static_b = args.static_batch_size or args.max_num_seqs
    # The memory a static batch of B sequences padded to the longest prompt + output needs;
    # paged, continuous batching fits more sequences in it (--max-num-seqs).
    num_blocks = static_b * -(-(2 * args.max_len) // BLOCK_SIZE) + 64
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, device=device)
    settings = {
        "model": {**model_config, "name": args.model, "seed": MODEL_SEED, "dtype": "float32"},
        "max_num_seqs": args.max_num_seqs,
        "static_batch_size": static_b,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": BLOCK_SIZE,
        "num_blocks": num_blocks,
        "prepacked_linear": runner.is_prepacked,
        "linear": runner.linear_path,
        "elementwise": getattr(runner, "elementwise_path", "torch"),  # older trees: torch
        "decode_attention": getattr(runner, "decode_attention_path", "torch"),
        "device": str(device),
    }
    print("settings:", settings, flush=True)

    systems_run: dict[str, Callable[[list[Request]], Run]] = {}
    if "continuous" in systems:
        systems_run["continuous"] = lambda reqs: run_continuous(
            runner, reqs, args.max_num_seqs, args.max_num_batched_tokens
        )
    if "static" in systems:
        batch_fn = runner_batch(runner, max_len=args.max_len)
        systems_run["static"] = lambda reqs: static_batches(reqs, static_b, batch_fn)
    if "padded" in systems:
        padded_fn = runner_batch(runner, keep_finished=True, max_len=args.max_len)
        systems_run["padded"] = lambda reqs: static_batches(reqs, static_b, padded_fn)
    if "classic" in systems:
        classic_fn = runner_batch(runner, keep_finished=True, max_len=args.max_len,
                                  pad_prompts=True)  # fmt: skip
        systems_run["classic"] = lambda reqs: static_batches(reqs, static_b, classic_fn)
    if "hf" in systems:
        from transformers import LlamaForCausalLM

        folder = save_hf_folder(model, Path(tempfile.mkdtemp(prefix="bench_generation_")))
        hf_model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        hf_fn = hf_batch(hf_model)
        systems_run["hf"] = lambda reqs: static_batches(reqs, static_b, hf_fn)

    warmup = [Request(10_000 + i, r.prompt[:48], min(r.output_len, 24), 0.0) for i, r in
              enumerate(workload[:8])]  # fmt: skip
    for name, run_fn in systems_run.items():
        started = time.perf_counter()
        run_fn(warmup)
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)

    rows: list[dict[str, Any]] = []
    overhead: dict[str, Any] = {}
    runs: dict[tuple[str, str], Run] = {}
    for pattern in patterns:
        requests = with_arrivals(workload, pattern, args.rate_rps, WORKLOAD_SEED)
        for name, run_fn in systems_run.items():
            run = run_fn(requests)
            runs[pattern, name] = run
            row = {"pattern": pattern, "system": name, **summarize(run, requests)}
            rows.append(row)
            print(
                f"{pattern:12} {name:10} {row['makespan_s']:6.1f} s "
                f"{row['output_tokens_per_s']:6.0f} tok/s  TTFT p50 {row['ttft_p50_ms']:.0f} ms",
                flush=True,
            )
            if name == "continuous":
                overhead[pattern] = step_overhead(run.steps, OVERHEAD_BATCH)
                overhead[pattern]["num_steps_total"] = len(run.steps)

    parity: dict[str, float] = {}
    for pattern in patterns:
        for base in BASELINES:
            if (pattern, "continuous") in runs and (pattern, base) in runs:
                parity[f"{pattern}/continuous_vs_{base}"] = agreement(
                    runs[pattern, "continuous"], runs[pattern, base]
                )

    print()
    print(table(rows))
    print()
    found = ratios(rows)
    for key, value in found.items():
        print(
            f"{key:36} throughput x{value['throughput']:.2f}  "
            f"TTFT p50 x{value['ttft_p50']:.1f}  TTFT p99 x{value['ttft_p99']:.1f}  "
            f"E2E p50 x{value['e2e_p50']:.1f}"
        )
    for pattern, o in overhead.items():
        if o["num_steps"]:
            print(
                f"step overhead at batch {o['batch']} ({pattern}): median "
                f"{o['share_median']:.1%} of the step, {o['share_of_total']:.1%} of their total "
                f"({o['num_steps']} steps, median step {o['step_median_ms']:.2f} ms, "
                f"outside the model {o['outside_median_ms']:.2f} ms)"
            )
        else:
            print(f"step overhead at batch {OVERHEAD_BATCH} ({pattern}): no such steps")
    print("identical greedy outputs:", {k: f"{v:.0%}" for k, v in parity.items()})
    write_results(
        args.json,
        {
            "benchmark": "generation",
            "date": utc_now(),
            "machine": machine,
            "settings": settings,
            "workload": workload_info,
            "single_runs": True,
            "results": rows,
            "ratios": found,
            "step_overhead": overhead,
            "identical_outputs": parity,
        },
    )


if __name__ == "__main__":
    main()
