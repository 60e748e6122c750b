"""CPU per request of the ``--workers`` hand-off's records, one record per request
against one group record per loop turn, in one process (no sockets, no scheduling).

A W1-shaped request (INPUT0: 256 float32) goes worker -> engine and its answer (OUTPUT0:
16 float32) comes back. Per request, as before grouping: an INFER record encoded and
decoded, a RESULT record encoded and decoded. Grouped, for ``G`` requests a turn: one
INFERS record encoded, decoded and split, one RESULTS record the same (``G`` = 1: the
record of its own that the Grouper sends instead). Both through
``bytes`` joined as the ring would copy them. CPU is ``time.process_time``; the rounds
alternate the two ways and the median round is kept.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_handoff.py [--groups 1,8,16,32]

Writes benchmarks/results/handoff.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import benchlib
from carpool.server.workers.records import Kind, decode, encode, encode_group, split_group

OPTIONS = {"priority": None, "timeout_s": None, "cost": None}


def _joined(parts: list[bytes | memoryview]) -> bytearray:
    return bytearray(b"".join(parts))


def per_record(items: list[dict[str, Any]], inputs: list[Any], outputs: list[Any]) -> None:
    for item, x, y in zip(items, inputs, outputs, strict=True):
        sent = decode(_joined(encode(Kind.INFER, item, x)))
        decode(_joined(encode(Kind.RESULT, {"id": sent.header["id"]}, y)))


def grouped(items: list[dict[str, Any]], inputs: list[Any], outputs: list[Any]) -> None:
    if len(items) == 1:  # as the Grouper sends a request alone in its turn
        per_record(items, inputs, outputs)
        return
    sent = split_group(decode(_joined(encode_group(Kind.INFERS, items, inputs))))
    ids = [item["id"] for item, _ in sent]
    split_group(decode(_joined(encode_group(Kind.RESULTS, ids, outputs))))


def cpu_us_per_request(way: Callable[..., None], group: int, num_requests: int) -> float:
    rng = np.random.default_rng(0)
    items = [{"model": "mlp", "options": OPTIONS, "arrival_s": 1.5, "id": i} for i in range(group)]
    inputs = [{"INPUT0": rng.random((1, 256), dtype=np.float32)} for _ in range(group)]
    outputs = [{"OUTPUT0": rng.random((1, 16), dtype=np.float32)} for _ in range(group)]
    turns = max(1, num_requests // group)
    start = time.process_time()
    for _ in range(turns):
        way(items, inputs, outputs)
    return (time.process_time() - start) / (turns * group) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", default="1,8,16,32", help="requests per loop turn")
    parser.add_argument("--requests", type=int, default=20000, help="per way, group and round")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; medians are kept")
    parser.add_argument("--out", type=Path, default=benchlib.RESULTS / "handoff.json")
    args = parser.parse_args()
    machine = benchlib.machine_info()
    print(f"machine: {machine}")
    rows = []
    for group in (int(g) for g in args.groups.split(",")):
        runs: dict[str, list[float]] = {"per_record": [], "grouped": []}
        for _ in range(args.repeat):
            runs["per_record"].append(cpu_us_per_request(per_record, group, args.requests))
            runs["grouped"].append(cpu_us_per_request(grouped, group, args.requests))
        old, new = (statistics.median(runs[k]) for k in ("per_record", "grouped"))
        print(
            f"{group:3d} requests a turn: per record {old:6.2f} us, grouped {new:6.2f} us "
            f"CPU per request ({new / old:.2f}x)"
        )
        rows.append(
            {
                "requests_per_turn": group,
                "per_record_cpu_us": round(old, 2),
                "grouped_cpu_us": round(new, 2),
                "ratio": round(new / old, 3),
                "runs": {k: [round(v, 2) for v in vs] for k, vs in runs.items()},
            }
        )
    benchlib.write_results(
        args.out,
        {"machine": machine, "utc": benchlib.utc_now(), "repeat": args.repeat, "rows": rows},
    )


if __name__ == "__main__":
    main()
