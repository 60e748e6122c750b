"""The Linear layers of the two systems side by side: PyTorch's prepacked oneDNN linear
(what carpool's generation models run, ``carpool.models.onednn``) against vLLM's CPU build's
own oneDNN handle (``vllm._custom_ops.create_onednn_mm`` / ``onednn_mm``, what vLLM 0.32's
``dispatch_cpu_unquantized_gemm`` picks for float32 dense layers), and plain
``F.linear``, on the shapes of the 88 M folder of ``bench_vs_vllm.py`` (hidden 768, the
fused qkv 1280, KV 256, the fused gate_up 4096, down 2048 -> 768) at M = 1024 (prefill),
64 and 8 (decode) rows.

Everything is timed in one process of vLLM's virtual environment (the same torch,
2.13.0+cpu, as carpool's), one thread, pinned to ``--cpu``: the median of ``--repeats``
calls after three warm-ups, each op in turn per shape. Results:
``benchmarks/results/matmul_vs_vllm.json``.

    .venv/bin/python benchmarks/bench_matmul_vs_vllm.py [--vllm-python /work/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

from benchlib import RESULTS, machine_info, utc_now, write_results

SHAPES = ((768, 768), (1280, 768), (256, 768), (4096, 768), (768, 2048))  # (N, K)
ROWS = (1024, 64, 8)

# Runs in vLLM's venv: argv[1] is {"shapes": [[N, K], ...], "rows": [...], "repeats": R}.
TIMER = """
import json, sys, time
import torch
import vllm._custom_ops as ops
torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
def timed(fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(spec["repeats"]):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3
rows = []
for m in spec["rows"]:
    for n, k in spec["shapes"]:
        torch.manual_seed(0)
        w, x = torch.randn(n, k), torch.randn(m, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        handle = ops.create_onednn_mm(w.t(), 32)
        ms = {
            "torch_onednn_prepacked": timed(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
            "vllm_onednn_mm": timed(lambda: ops.onednn_mm(handle, x, None)),
            "f_linear": timed(lambda: torch.nn.functional.linear(x, w)),
        }
        gflop = 2 * m * n * k / 1e9
        rows.append({"m": m, "n": n, "k": k, "ms": ms,
                     "gflops": {name: gflop / t * 1e3 for name, t in ms.items()}})
print("RESULT " + json.dumps(rows))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--cpu", default="1")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=RESULTS / "matmul_vs_vllm.json")
    args = parser.parse_args()
    machine = machine_info(cpu=args.cpu)
    print("machine:", machine, flush=True)
    spec = {"shapes": SHAPES, "rows": ROWS, "repeats": args.repeats}
    taskset = ["taskset", "-c", args.cpu] if shutil.which("taskset") else []
    done = subprocess.run(
        [*taskset, args.vllm_python, "-c", TIMER, json.dumps(spec)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    rows = json.loads(line.removeprefix("RESULT "))
    for r in rows:
        figures = "  ".join(f"{name} {ms:.3f} ms ({r['gflops'][name]:.0f} GFLOP/s)"
                            for name, ms in r["ms"].items())  # fmt: skip
        print(f"M={r['m']:5d} N={r['n']:5d} K={r['k']:5d}  {figures}")
    write_results(
        args.json,
        {"benchmark": "matmul_vs_vllm", "date": utc_now(), "machine": machine,
         "settings": {"repeats": args.repeats, "threads": 1}, "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
