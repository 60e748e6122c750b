"""Before and after a change, in one run: a benchmark script run alternately against two
source trees of carpool, its figures compared as medians and ratios.

A change meant to move structure, not speed, is checked this way: the same script, the
same machine, the two trees taking turns (A B, B A, A B, ...) so that drift of a shared
machine falls on both alike.

    git worktree add --detach /tmp/before <commit>
    .venv/bin/python benchmarks/bench_ab.py --before /tmp/before/src --label NAME \\
        --rounds 3 bench_http.py -- --duration-s 5 --repeats 1 --rates 1000

The script (``bench_http.py``, ``bench_peers.py`` or ``bench_decode_step.py``, run from
this checkout) runs with ``PYTHONPATH`` set to each tree, so it and the servers it starts
import that tree's carpool; what it writes with ``--json`` is read back. Reported per
figure (closed-loop req/s and p50/p99 at each concurrency, per server for
``bench_peers.py``; step and set-up ms per batch size for ``bench_decode_step.py``; step and
attention ms per chunk for ``bench_prefill_step.py``; prefill and decode seconds for
``bench_long_context.py``; CPU per request per worker count for ``bench_workers.py``): each
tree's runs, their medians, and after/before. Results go to
``benchmarks/results/ab_<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import RESULTS, ROOT, machine_info, utc_now, write_results

Figures = dict[str, float]


def http_figures(result: dict[str, Any]) -> Figures:
    """``bench_http.py``'s closed-loop rows: req/s, p50 and p99 per concurrency, and
    req/s over the offline W1 ceiling measured around it (``of ceiling``: a shared core
    that slows the model slows this run's ceiling too) and the mean batch size."""
    figures: Figures = {}
    for row in result["rows"]:
        c = row["concurrency"]
        figures |= {f"c{c} req/s": row["rate_rps"], f"c{c} p50 ms": row["p50_ms"]}
        figures[f"c{c} p99 ms"] = row["p99_ms"]
        # Absent from the rows of a tree whose bench_http.py predates them.
        if "ratio_to_ceiling" in row:
            figures[f"c{c} of ceiling"] = row["ratio_to_ceiling"]
        if "mean_batch_size" in row:
            figures[f"c{c} mean batch"] = row["mean_batch_size"]
    return figures


def peers_figures(result: dict[str, Any]) -> Figures:
    """``bench_peers.py``'s rows: req/s and p99 per server and concurrency."""
    figures: Figures = {}
    for server in result["results"]:
        for row in server.get("rows", []):
            key = f"{server['server']} c{row['concurrency']}"
            figures |= {f"{key} req/s": row["rate_rps"], f"{key} p99 ms": row["p99_ms"]}
    return figures


def decode_step_figures(result: dict[str, Any]) -> Figures:
    """``bench_decode_step.py``'s rows: the step and its set-up, per batch size, and,
    profiled, decode attention with the K/V gather it needs (``attention+gather``)."""
    figures: Figures = {}
    for row in result["rows"]:
        n = row["num_seqs"]
        figures |= {f"n{n} step ms": row["step_ms"], f"n{n} prepare ms": row["prepare_ms"]}
        if "profile_ms" in row:
            profile = row["profile_ms"]
            attention, gather = profile.get("attention", 0.0), profile.get("kv gather", 0.0)
            figures |= {f"n{n} attention ms": attention, f"n{n} kv gather ms": gather}
            figures[f"n{n} attention+gather ms"] = attention + gather
    return figures


def prefill_step_figures(result: dict[str, Any]) -> Figures:
    """``bench_prefill_step.py``'s rows: the step and, profiled, its attention, per chunk."""
    figures: Figures = {}
    for row in result["rows"]:
        case = f"{row['num_tokens']}@{row['num_cached']}"
        figures[f"{case} step ms"] = row["step_ms"]
        if "profile_ms" in row:
            figures[f"{case} attention ms"] = row["profile_ms"].get("attention", 0.0)
    return figures


def long_context_figures(result: dict[str, Any]) -> Figures:
    """``bench_long_context.py``'s run: seconds in prefill and decode-only steps."""
    figures = result["figures"]
    total_s = figures["prefill_s"] + figures["decode_s"]
    return {
        "prefill s": figures["prefill_s"],
        "decode s": figures["decode_s"],
        "output tok/s": figures["output_tokens"] / total_s,
    }


def workers_figures(result: dict[str, Any]) -> Figures:
    """``bench_workers.py``'s rows: the server's CPU per request and req/s per model and
    worker count, and the CPU per request's ratio to the run's first worker count."""
    figures: Figures = {}
    for row in result["rows"]:
        name = f"{row['model']} w{row['workers']}"
        figures[f"{name} CPU us/request"] = row["cpu_us_per_request"]
        figures[f"{name} req/s"] = row["rate_rps"]
        figures[f"{name} CPU ratio"] = row["cpu_ratio_to_first"]
    return figures


READERS: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "bench_decode_step.py": decode_step_figures,
    "bench_prefill_step.py": prefill_step_figures,
    "bench_http.py": http_figures,
    "bench_long_context.py": long_context_figures,
    "bench_peers.py": peers_figures,
    "bench_workers.py": workers_figures,
}


def run_once(script: str, tree: Path, args: list[str], out: Path) -> Figures:
    """``script`` with ``args`` against the carpool in ``tree``; its figures."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)]
    print(f"$ PYTHONPATH={tree} {' '.join(command[1:])}", flush=True)
    subprocess.run(command, env=env, check=True, cwd=ROOT)
    return READERS[script](json.loads(out.read_text()))


def compare(runs: dict[str, list[Figures]]) -> dict[str, dict[str, Any]]:
    """Per figure: both trees' runs, medians and after/before."""
    table: dict[str, dict[str, Any]] = {}
    for key in runs["before"][0]:
        before = [r[key] for r in runs["before"] if key in r]
        after = [r[key] for r in runs["after"] if key in r]
        if not before or not after:
            continue
        median_before, median_after = statistics.median(before), statistics.median(after)
        ratio = median_after / median_before if median_before else float("nan")
        table[key] = {
            "before": before,
            "after": after,
            "median_before": median_before,
            "median_after": median_after,
            "ratio": ratio,
        }
    return table


def _commit(tree: Path) -> str | None:
    """The commit a tree's checkout is at (None outside git), and "+changes" if dirty."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True)
    if head.returncode:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "."], capture_output=True
    )
    return head.stdout.decode().strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="the src/ of the old tree")
    parser.add_argument("--after", type=Path, default=ROOT / "src", help="default: this one")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree")
    parser.add_argument("--label", required=True)
    parser.add_argument("script", choices=sorted(READERS))
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="after --")
    args = parser.parse_args()
    script_args = [a for a in args.script_args if a != "--"]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        if not (tree / "carpool" / "__init__.py").exists():
            sys.exit(f"--{name} {tree}: no carpool package there (give the tree's src/)")
    machine = machine_info()
    print(f"machine: {machine}")
    runs: dict[str, list[Figures]] = {"before": [], "after": []}
    # Which decode attention each tree ran (bench_decode_step.py says; others: none).
    paths: dict[str, set[str]] = {"before": set(), "after": set()}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            order = ("before", "after") if index % 2 == 0 else ("after", "before")
            for name in order:
                out = Path(tmp) / f"{name}{index}.json"
                runs[name].append(run_once(args.script, trees[name], script_args, out))
                path = json.loads(out.read_text()).get("decode_attention")
                if path is not None:
                    paths[name].add(path)
    table = compare(runs)
    decode_attention = {name: sorted(found) for name, found in paths.items() if found}
    if decode_attention:
        print(f"decode attention: {decode_attention}")
    print(f"{'figure':<32}{'before':>12}{'after':>12}{'after/before':>14}")
    for key, row in table.items():
        print(
            f"{key:<32}{row['median_before']:>12.2f}{row['median_after']:>12.2f}"
            f"{row['ratio']:>14.3f}"
        )
    write_results(
        RESULTS / f"ab_{args.label}.json",
        {
            "machine": machine,
            "finished": utc_now(),
            "script": args.script,
            "script_args": script_args,
            "trees": {k: {"src": str(v), "commit": _commit(v)} for k, v in trees.items()},
            "rounds": args.rounds,
            **({"decode_attention": decode_attention} if decode_attention else {}),
            "figures": table,
        },
    )


if __name__ == "__main__":
    main()
