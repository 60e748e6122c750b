"""Memory held for a streaming client that stops reading: the server's RSS and the tokens
it generated while one stalled stream stays open.

`carpool serve` with the built-in models (pinned to the server CPU) gets one
``/v1/completions`` request for ``tiny-random-llama``: ``stream``, ``n`` choices,
``max_tokens`` each, ``ignore_eos``, ``logprobs`` top log-probabilities a token; its client
(on the load CPU) sets a 1 KiB receive buffer and reads nothing. The server's RSS and its
``carpool_generation_tokens_total`` are sampled every 0.5 s for ``--seconds``; then the
client closes. Each server in ``--src`` runs in turn in the same run: its ``src`` folder
goes first on the server's ``PYTHONPATH`` (this checkout's by default; an older commit's
worktree shows the same request before a change).

    .venv/bin/python benchmarks/stalled_reader_memory.py \\
        [--src NAME=PATH ...] [--n 128] [--max-tokens 900] [--logprobs 20] [--seconds 40]

Writes benchmarks/results/stalled_reader_memory.json (``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchlib import (
    LOAD_CPU,
    RESULTS,
    ROOT,
    carpool_serve,
    machine_info,
    start_server,
    stop_server,
    utc_now,
    wait_kserve_ready,
    write_results,
)
from burst_memory import rss_mib
from wrkrun import free_port

MODEL = "tiny-random-llama"
TOKENS = re.compile(rb'^carpool_generation_tokens_total\{model="tiny-random-llama"\} (\S+)$', re.M)


def _tokens(url: str) -> float:
    found = TOKENS.search(httpx.get(f"{url}/metrics", timeout=10).content)
    return float(found.group(1)) if found else float("nan")


def _stalled_client(port: int, document: dict[str, Any]) -> socket.socket:
    body = orjson.dumps(document)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def run(name: str, src: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/stalled_reader_{name}.log")
    process = start_server(carpool_serve(port), {"PYTHONPATH": str(src)}, log)
    document = {
        "model": MODEL, "prompt": "hello", "stream": True, "ignore_eos": True, "n": args.n,
        "max_tokens": args.max_tokens, "logprobs": args.logprobs,
    }  # fmt: skip
    try:
        wait_kserve_ready(url, process, timeout_s=120)
        time.sleep(1.0)
        rss_before, tokens_before = rss_mib(process.pid), _tokens(url)
        sock = _stalled_client(port, document)
        samples = []
        started = time.monotonic()
        try:
            while (elapsed := time.monotonic() - started) < args.seconds:
                time.sleep(0.5)
                samples.append(
                    {
                        "s": round(elapsed, 1),
                        "rss_growth_mib": round(rss_mib(process.pid) - rss_before, 1),
                        "tokens": _tokens(url) - tokens_before,
                    }
                )
        finally:
            sock.close()
    finally:
        stop_server(process)
    last = samples[-1]
    return {
        "server": name,
        "src": str(src),
        "rss_before_mib": round(rss_before, 1),
        "peak_rss_growth_mib": max(s["rss_growth_mib"] for s in samples),
        "tokens_generated": last["tokens"],
        "tokens_asked": args.n * args.max_tokens,
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--src", action="append", default=[], help="NAME=PATH of a src folder (repeatable)"
    )
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=900)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "stalled_reader_memory.json")
    args = parser.parse_args()
    sources = [tuple(s.split("=", 1)) for s in args.src] or [("this", str(ROOT / "src"))]
    os.sched_setaffinity(0, {int(LOAD_CPU)})
    results = []
    for name, src in sources:
        result = run(name, Path(src), args)
        results.append(result)
        print(
            f"{name:>10}: RSS +{result['peak_rss_growth_mib']:.0f} MiB at most; "
            f"{result['tokens_generated']:.0f} of {result['tokens_asked']} tokens generated "
            f"in {args.seconds:g} s while the client read nothing",
            flush=True,
        )
    write_results(
        args.out,
        {
            "benchmark": "stalled_reader_memory",
            "date": utc_now(),
            "machine": machine_info(),
            "request": {"n": args.n, "max_tokens": args.max_tokens, "logprobs": args.logprobs},
            "seconds": args.seconds,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
