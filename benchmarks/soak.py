"""Soak: `carpool serve` at 10x its capacity for a minute, open and closed loop, with and
without limits; what it answered, refused and lost, how fast, and its memory.

    .venv/bin/python benchmarks/soak.py [--duration-s 60] [--label NAME]
    .venv/bin/python benchmarks/soak.py --quick        # smoke: 5 s runs, label "quick"

Each run starts a fresh server (W1 ``mlp`` on one core, ``--server-cpus``; the load
generator and the watcher on ``--load-cpus``), then:

1. warm-up: 2 s closed loop at 64 connections;
2. capacity: ``--capacity-s`` closed loop at ``--capacity-connections`` (256): answers/s;
3. overload for ``--duration-s`` at ``--multiplier`` (10) x that capacity, either
   * ``open``: Poisson arrivals at 10x capacity on a pool of up to ``--open-connections``
     (1000) keep-alive connections, each request timed on its own, or
   * ``closed``: ``--closed-connections`` (1000) connections writing their next request
     the moment an answer comes, a refusal included (instant retry);
4. the answers still due get ``--drain-s`` (15 s); then 5 s idle and the server's RSS;
5. SIGTERM, and how the server exited.

Configs: ``default`` serves the model as given (the built-in ``mlp``: batch <= 64 within
2 ms, no queue bound, no timeout); ``limits`` adds ``--limits`` to it (by default
``max_queue_size=512,timeout_s=0.5``, the issue's). ``--config FILE --model NAME`` soaks
another model of a serve config instead (it must take W1's request: INPUT0 FP32 [1, 256]);
its limits overlay is written beside FILE (so relative sources still resolve) and removed.
``--serve-args "..."`` passes more options to every `carpool serve` (``--max-connections
4096``, say). ``--modes`` and ``--configs`` choose among the four runs.

The request is one pre-encoded W1 request (1 x 256 float32, seed 0) as ``tritonclient``
sends it, binary tensors after a JSON header (``--body json``: KServe JSON instead). What
is counted and how is in soakstats.py and soakload.py; the watcher (soakmonitor.py) probes
``/v2/health/ready`` on a new connection every 100 ms and reads the server's VmRSS each
second. A run prints and records, per phase, counts by status and outcome, goodput, the
offered rate against the target rate (one Python process may not reach 10x: then it says
so), p50/p99 of answers and of refusals, health p50/p99, RSS each second, and RSS 5 s
after the load; then the issue's targets, PASS or FAIL, measured in that run. Results go
to ``benchmarks/results/soak_<label>.json``; the exit status is 1 when a target fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from benchlib import (
    LOAD_CPU,
    RESULTS,
    SERVER_CPU,
    carpool_serve,
    machine_info,
    start_server,
    stop_server,
    utc_now,
    wait_kserve_ready,
    write_results,
)
from carpool.tools.httpclient import encode_request
from soakload import closed_loop, new_event_loop, open_loop
from soakmonitor import read_rss_kib
from soakstats import (
    Targets,
    check_targets,
    health_summary,
    rss_summary,
    shortfall,
    summarise_load,
    table,
)
from wrkrun import free_port, write_w1_binary_body

HERE = Path(__file__).resolve().parent
MODES = ("open", "closed")
CONFIGS = ("default", "limits")
DEFAULT_LIMITS = "max_queue_size=512,timeout_s=0.5"
WARMUP_S = 2.0
WARMUP_CONNECTIONS = 64
AFTER_S = 5.0
SEED = 0
DEFAULT_TARGETS = Targets()
# The built-in mlp as a config file lists it (server/defaults.py), so limits can be added.
MLP_CONFIG = {
    "name": "mlp",
    "kind": "python",
    "source": "carpool.server.defaults:w1_factory",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [256]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
    "max_batch_size": 64,
    "max_delay_s": 0.002,
}


def parse_limits(text: str) -> dict[str, int | float]:
    """``max_queue_size=512,timeout_s=0.5`` as a mapping (integers stay integers)."""
    limits: dict[str, int | float] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--limits: expected key=value pairs, got {item!r}")
        number = float(value)
        limits[key.strip()] = int(number) if number.is_integer() and "." not in value else number
    return limits


@contextlib.contextmanager
def served_config(args: argparse.Namespace, limits: dict[str, Any]) -> Iterator[Path]:
    """A serve config: ``--config`` (or the built-in mlp) with ``limits`` on the model."""
    if args.config is not None and not limits:
        yield args.config
        return
    with contextlib.ExitStack() as stack:
        if args.config is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
            document: dict[str, Any] = {"models": [{**MLP_CONFIG, **limits}]}
        else:  # beside the original, so that its relative paths still resolve
            folder = args.config.resolve().parent
            document = yaml.safe_load(args.config.read_text())
            models = [m for m in document["models"] if m.get("name") == args.model]
            if not models:
                raise SystemExit(f"--config {args.config} lists no model named {args.model!r}")
            models[0].update(limits)
        path = folder / f".soak-{os.getpid()}.yaml"
        path.write_text(yaml.safe_dump(document))
        stack.callback(path.unlink, missing_ok=True)
        yield path


def w1_request(host: str, port: int, model: str, body_kind: str) -> bytes:
    """One encoded W1 infer request: binary tensors after a JSON header, or KServe JSON."""
    path = f"/v2/models/{model}/infer"
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "body.bin"
        header_length = write_w1_binary_body(file)
        body = file.read_bytes()
    if body_kind == "json":
        x = np.frombuffer(body[header_length:], dtype="<f4")
        tensor = {"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": x.tolist()}
        document = {"inputs": [tensor]}
        headers = {"Content-Type": "application/json"}
        return encode_request("POST", f"{host}:{port}", path, orjson.dumps(document), headers)
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(header_length),
    }
    return encode_request("POST", f"{host}:{port}", path, body, headers)


def _rss_in(samples: list[dict[str, Any]], start: float, end: float) -> list[int]:
    return [s["rss_kib"] for s in samples if s["kind"] == "rss" and start <= s["t"] < end]


def _phase_line(name: str, load: dict[str, Any]) -> str:
    target = load["target_rate_rps"]
    offered = f"offered {load['offered_rate_rps']:.0f} req/s"
    if target is not None:
        offered += f" of {target:.0f} targeted"
    answered = load["answered"] or {}
    return (
        f"  {name}: goodput {load['goodput_rps']:.0f} req/s, {offered}, statuses "
        f"{load['statuses']}, lost {load['num_lost']}, unanswered {load['num_unanswered']}, "
        f"not accepted {load['num_not_accepted']}, unsent {load['num_unsent']}, answered p99 "
        f"{answered.get('p99_ms', float('nan')):.1f} ms, client CPU "
        f"{load['client_cpu_ratio']:.0%}"
    )


def run_one(
    args: argparse.Namespace, config_name: str, mode: str, limits: dict[str, Any]
) -> dict[str, Any]:
    """One fresh server through warm-up, capacity, overload and its stop."""
    name = f"{config_name}-{mode}"
    print(f"== {name}", flush=True)
    host, port = "127.0.0.1", free_port()
    log = Path(tempfile.gettempdir()) / f"soak_{name}_{port}.log"
    loop = new_event_loop()
    request = w1_request(host, port, args.model, args.body)
    watch_file = Path(tempfile.gettempdir()) / f"soak_{name}_{port}.jsonl"
    with served_config(args, limits) as config:
        argv = [*carpool_serve(port, 0, config), *shlex.split(args.serve_args)]
        process = start_server(argv, {}, log, cpu=args.server_cpus)
        watcher: subprocess.Popen[bytes] | None = None
        try:
            wait_kserve_ready(f"http://{host}:{port}", process, timeout_s=120)
            watcher = subprocess.Popen(
                [sys.executable, str(HERE / "soakmonitor.py"), "--pid", str(process.pid),
                 "--port", str(port), "--out", str(watch_file)],
                stdin=subprocess.PIPE,
            )  # fmt: skip
            loop.run_until_complete(
                closed_loop(host, port, request, WARMUP_CONNECTIONS, WARMUP_S, args.drain_s)
            )
            capacity = summarise_load(
                loop.run_until_complete(
                    closed_loop(
                        host, port, request, args.capacity_connections, args.capacity_s,
                        args.drain_s,
                    )
                ),
                None,
            )  # fmt: skip
            print(_phase_line("capacity", capacity), flush=True)
            target = args.multiplier * capacity["goodput_rps"]
            baseline_kib = read_rss_kib(process.pid) or 0
            load_start = time.monotonic()
            if mode == "open":
                tally = loop.run_until_complete(
                    open_loop(
                        host, port, request, target, args.duration_s, args.drain_s,
                        max_connections=args.open_connections, seed=SEED,
                    )
                )  # fmt: skip
            else:
                tally = loop.run_until_complete(
                    closed_loop(
                        host, port, request, args.closed_connections, args.duration_s,
                        args.drain_s,
                    )
                )  # fmt: skip
            load_end = load_start + args.duration_s
            load = summarise_load(tally, target if mode == "open" else None)
            print(_phase_line(mode, load), flush=True)
            time.sleep(AFTER_S)  # the server idle, then how much memory it kept
            after_kib = read_rss_kib(process.pid) or 0
        finally:
            is_alive = process.poll() is None
            if watcher is not None:
                assert watcher.stdin is not None
                watcher.stdin.close()
                watcher.wait(timeout=30)
            stop_start = time.monotonic()
            exit_status = stop_server(process)
            stop_s = time.monotonic() - stop_start
            loop.close()
    samples = [json.loads(line) for line in watch_file.read_text().splitlines()]
    watch_file.unlink()
    run = {
        "name": name,
        "config": config_name,
        "mode": mode,
        "limits": limits,
        "log": str(log),
        "capacity_rps": capacity["goodput_rps"],
        "capacity": capacity,
        "load": load,
        "shortfall": shortfall(load),
        "health": health_summary(samples, load_start, load_end),
        "health_kept": health_summary(samples, load_start, load_end, kind="health_kept"),
        "health_before": health_summary(samples, 0.0, load_start),  # warm-up, capacity
        # Every probe: kind, seconds from the overload's start, latency in ms, status.
        "health_samples": [
            [s["kind"], round(s["t"] - load_start, 3), round(s["latency_s"] * 1e3, 2), s["status"]]
            for s in samples
            if s["kind"] != "rss"
        ],
        "rss": rss_summary(_rss_in(samples, load_start, load_end), baseline_kib, after_kib),
        "is_alive_at_end": is_alive,
        "exit_status": exit_status,
        "stop_s": stop_s,
    }
    print(
        f"  {'alive' if is_alive else 'DEAD'} at the end; after SIGTERM it exited with "
        f"{exit_status} in {stop_s:.1f} s",
        flush=True,
    )
    if run["shortfall"] == "client CPU-bound":
        print(
            f"  the load generator was CPU-bound: it offered {load['offered_rate_rps']:.0f} "
            f"of the {target:.0f} req/s asked for (one Python process on one core)",
            flush=True,
        )
    elif run["shortfall"] == "connection pool full":
        print(
            f"  every connection of the pool was busy: {load['num_unsent']} arrivals waited "
            "in the client and were never sent",
            flush=True,
        )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=60.0, help="overload, per run")
    parser.add_argument("--capacity-s", type=float, default=10.0)
    parser.add_argument("--capacity-connections", type=int, default=256)
    parser.add_argument("--multiplier", type=float, default=10.0, help="x capacity")
    parser.add_argument("--open-connections", type=int, default=1000)
    parser.add_argument("--closed-connections", type=int, default=1000)
    parser.add_argument("--drain-s", type=float, default=15.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--limits", default=DEFAULT_LIMITS, help="the limits config's keys")
    parser.add_argument("--config", type=Path, help="a serve config instead of the mlp")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--body", choices=("binary", "json"), default="binary")
    parser.add_argument("--serve-args", default="", help="more `carpool serve` options")
    parser.add_argument("--server-cpus", default=SERVER_CPU)
    parser.add_argument("--load-cpus", default=LOAD_CPU)
    parser.add_argument("--rss-budget-mib", type=float, default=DEFAULT_TARGETS.rss_budget_mib)
    parser.add_argument("--rss-return-mib", type=float, default=DEFAULT_TARGETS.rss_return_mib)
    parser.add_argument("--label", help="results go to soak_<label>.json (default: run)")
    parser.add_argument("--json", type=Path, help="overrides the path --label gives")
    parser.add_argument("--quick", action="store_true", help="smoke: 5 s runs, 3 s capacity")
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.capacity_s, args.drain_s = 5.0, 3.0, 5.0
    label = args.label or ("quick" if args.quick else "run")
    path = args.json or RESULTS / f"soak_{label}.json"
    modes = [m for m in args.modes.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    if set(modes) - set(MODES) or set(configs) - set(CONFIGS):
        raise SystemExit(f"--modes: a subset of {MODES}; --configs: a subset of {CONFIGS}")
    limits = parse_limits(args.limits)
    os.sched_setaffinity(0, {int(cpu) for cpu in args.load_cpus.split(",")})
    machine = machine_info(server_cpus=args.server_cpus, load_cpus=args.load_cpus)
    print(f"machine: {machine}", flush=True)
    targets = Targets(
        timeout_s=float(limits.get("timeout_s", DEFAULT_TARGETS.timeout_s)),
        rss_budget_mib=args.rss_budget_mib,
        rss_return_mib=args.rss_return_mib,
    )
    runs = [
        run_one(args, config, mode, limits if config == "limits" else {})
        for config in configs
        for mode in modes
    ]
    print(table(runs))
    checks = {}
    failed = False
    for run in runs:
        found = check_targets(run, targets, has_limits=run["config"] == "limits")
        checks[run["name"]] = [{**asdict(c), "verdict": c.verdict} for c in found]
        print(f"targets, {run['name']}:")
        for check in found:
            print(f"  {check.verdict:4} {check.name}: {check.measured} (target {check.limit})")
            failed |= check.passed is False
    write_results(
        path,
        {
            "when": utc_now(),
            "machine": machine,
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "targets": asdict(targets),
            "runs": runs,
            "checks": checks,
        },
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
