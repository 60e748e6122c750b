"""Shared by the benchmark scripts: machine info, server processes, result files.

Imported by plain name (``from benchlib import ...``) from scripts run as
``.venv/bin/python benchmarks/<script>.py``; importing it starts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from carpool.tools.machine import cpu_flags, cpu_model, torch_kernels
from wrkrun import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The server is pinned to one core, the load generator to the other; swap them with
# CARPOOL_BENCH_SERVER_CPU=1 CARPOOL_BENCH_LOAD_CPU=0 when core 0 is busy with other work.
SERVER_CPU = os.environ.get("CARPOOL_BENCH_SERVER_CPU", "0")
LOAD_CPU = os.environ.get("CARPOOL_BENCH_LOAD_CPU", "1")
READY_TIMEOUT_S = 300.0


class Named(Protocol):
    """Anything with a ``name`` (a benchmark's server description)."""

    name: str


NamedT = TypeVar("NamedT", bound=Named)


def machine_info(**extra: Any) -> dict[str, Any]:
    """Platform, CPU model, flags and count, Python and torch versions, the kernels chosen
    on this CPU, then ``extra`` in order."""
    import torch

    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "kernels": torch_kernels(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **extra,
    }


def serving_malloc() -> str:
    """Set this process's allocator as ``carpool serve`` sets its own
    (:mod:`carpool.core.allocator`), so that an in-process benchmark of a model measures
    what the server runs; the line saying what was set. A tree older than that module
    keeps glibc's defaults (``bench_ab.py`` compares such trees)."""
    try:
        from carpool.core.allocator import tune_malloc
    except ImportError:
        return "malloc: glibc's defaults (this tree does not set them)"
    return tune_malloc()


def wrk_info() -> dict[str, str]:
    """The CPUs the server and `wrk` are pinned to, and wrk's version line."""
    version = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout
    return {"server_cpu": SERVER_CPU, "load_cpu": LOAD_CPU, "wrk": version.split("\n")[0]}


def proc_stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file (a process's or a thread's) after "pid (comm) ":
    state(0) ppid pgrp session(3) ... utime(11) stime(12). OSError once it has ended."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def stat_cpu_s(path: str) -> float:
    """CPU seconds (user + system) a /proc stat file counts."""
    fields = proc_stat_fields(path)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc/PID/stat."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def venv_version(python: Path, package: str) -> str | None:
    """``package``'s version in the virtual environment of ``python``; None if absent."""
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def require_wrk(script: str) -> None:
    """Exits with a hint unless `wrk` and `taskset` are on PATH."""
    if shutil.which("wrk") is None or shutil.which("taskset") is None:
        sys.exit(f"{script} needs wrk and taskset: apt-get install wrk util-linux")


def add_servers_option(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """``--servers``: a comma-separated subset of ``names``, all of them by default."""
    parser.add_argument(
        "--servers",
        default=",".join(names),
        help="comma-separated subset; results for others already in --json are kept",
    )


def chosen_servers(
    script: str, requested: str, servers: list[NamedT]
) -> tuple[list[str], list[NamedT]]:
    """Checks for `wrk`, then the names asked for and those of ``servers`` among them."""
    require_wrk(script)
    wanted = requested.split(",")
    return wanted, [s for s in servers if s.name in wanted]


def carpool_serve(port: int, grpc_port: int | str = 0, config: Path | None = None) -> list[str]:
    """The argv of ``carpool serve [config]`` on ``port``, from this interpreter."""
    source = [str(config)] if config is not None else []
    return [
        sys.executable,
        "-m",
        "carpool.cli",
        "serve",
        *source,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
    ]


def start_server(
    argv: list[str], env: dict[str, str], log: Path, cpu: str = SERVER_CPU
) -> subprocess.Popen[bytes]:
    """Starts ``argv`` pinned to ``cpu`` with OMP_NUM_THREADS=1 (plus ``env``).

    It runs in its own session (so `stop_server` can end the whole group), from the
    repository root, with stdout and stderr going to ``log``.
    """
    with log.open("wb") as log_file:
        return subprocess.Popen(
            ["taskset", "-c", cpu, *argv],
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )


def stop_server(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM the server's whole process group (it was started as its own session); its
    exit status (negative: the signal that ended it)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # stragglers left in the group
    return process.wait(timeout=10)


def wait_kserve_ready(
    url: str, process: subprocess.Popen[bytes] | None = None, timeout_s: float = 60.0
) -> None:
    """Poll ``url``/v2/health/ready until it answers 200 (carpool serve is up); fail at
    once if ``process`` (the server) has exited."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready within {timeout_s:g} s")


def wait_ready(
    process: subprocess.Popen[bytes],
    url: str,
    body: Any,
    request_timeout_s: float = 5.0,
    retry_statuses: Container[int] | None = None,
) -> tuple[float, httpx.Response]:
    """POSTs ``body`` every 0.5 s until a 200: seconds waited and that response.

    Raises if the server exits first or READY_TIMEOUT_S passes; with ``retry_statuses``,
    also on any other status than those and 200 (without, any status is retried).
    """
    start = time.perf_counter()
    while time.perf_counter() - start < READY_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            response = httpx.post(url, json=body, timeout=request_timeout_s)
            if response.status_code == 200:
                return time.perf_counter() - start, response
            if retry_statuses is not None and response.status_code not in retry_statuses:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready within {READY_TIMEOUT_S:.0f} s")


def run_server(
    name: str,
    label: str,
    command: Callable[[int], list[str]],
    path: str,
    env: dict[str, str],
    log_prefix: str,
    measure: Callable[[subprocess.Popen[bytes], str, dict[str, Any]], None],
) -> dict[str, Any]:
    """Starts one server on a free port, runs ``measure`` against it, always stops it.

    ``measure(process, url, result)`` fills ``result`` (already holding server, label and
    log). A server that fails is reported in ``result["error"]``, not raised.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}{path}"
    log = Path(tempfile.gettempdir()) / f"{log_prefix}_{name}.log"
    result: dict[str, Any] = {"server": name, "label": label, "log": str(log)}
    process = start_server(command(port), env, log)
    try:
        measure(process, url, result)
    except Exception as exc:  # a server that fails is reported, not fatal
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{name}: SKIPPED ({result['error']}); log {log}", flush=True)
    finally:
        stop_server(process)
    return result


def merge_results(
    path: Path, results: list[dict[str, Any]], wanted: Iterable[str], order: list[str]
) -> list[dict[str, Any]]:
    """``results`` plus the servers not in ``wanted`` from the file at ``path``, in ``order``."""
    wanted = set(wanted)
    kept: list[dict[str, Any]] = []
    if path.exists():
        kept = [
            r for r in json.loads(path.read_text()).get("results", []) if r["server"] not in wanted
        ]
    return sorted(kept + results, key=lambda r: order.index(r["server"]))


def _spec_width(spec: str) -> int:
    """The field width in a format spec such as ``>4`` or ``8.2f``."""
    match = re.search(r"[0-9]+", spec)
    if match is None:
        raise ValueError(f"no width in format spec {spec!r}")
    return int(match.group())


def results_table(
    results: list[dict[str, Any]],
    label_width: int,
    rate_spec: str = "8.0f",
    latency_width: int = 8,
    extra_columns: tuple[tuple[str, str, str], ...] = (),
) -> str:
    """The per-server wrk rows: one line per server and concurrency, under a header.

    Columns: concurrency, req/s, ``extra_columns`` ((title, row key, format spec) each),
    p50, p99, non-2xx; a server that failed gets one line with its error.
    """
    latency = f"{latency_width}.2f"
    columns = [
        ("conc", "concurrency", ">4"),
        ("req/s", "rate_rps", rate_spec),
        *extra_columns,
        ("p50 ms", "p50_ms", latency),
        ("p99 ms", "p99_ms", latency),
        ("non-2xx", "non_2xx", ">7"),
    ]
    header = [f"{'server':{label_width}}"]
    header += [f"{title:>{_spec_width(spec)}}" for title, _, spec in columns]
    lines = [" ".join(header)]
    for result in results:
        if "error" in result:
            lines.append(f"{result['label']:{label_width}} skipped: {result['error']}")
            continue
        for row in result["rows"]:
            cells = [format(row[key], spec) for _, key, spec in columns]
            lines.append(" ".join([f"{result['label']:{label_width}}", *cells]))
    return "\n".join(lines)


def corpus_info(texts: list[str], seed: int, **stats: float) -> dict[str, Any]:
    """The results' ``corpus`` entry: number of texts, seed, then ``stats`` in order."""
    return {"num_texts": len(texts), "seed": seed, **stats}


def write_results(path: Path, payload: dict[str, Any]) -> None:
    """Writes ``payload`` plus the command line (key ``command``) as JSON and says so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "command": " ".join(sys.argv)}, indent=2))
    print(f"wrote {path}")
