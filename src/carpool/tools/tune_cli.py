"""``carpool tune TARGET --slo-p99-ms MS --out CONFIG.yaml [options]``.

TARGET is ``module:attr`` (a batched model tuned in this process, named in any form of
:mod:`carpool.tools.modelref`; ``--shape`` gives one request's item), left out for
``--config FILE --model NAME`` (a model of a serve config, built and tuned in this process
as serve runs it), or ``http://HOST:PORT/v2/models/NAME`` (a model on a running carpool
server started with ``--allow-policy-updates``, tuned through its ``/policy`` endpoint; the
API key it requires, if any, from ``CARPOOL_API_KEY``). The best feasible config is written to
``--out`` as a config ``carpool serve`` loads; ``--report DIR`` adds the markdown/HTML report
and plots, ``--html FILE`` the same report as one self-contained file. Exit status: 0 with
a recommendation, 1 when no trial met the constraints, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from carpool.errors import ConfigError
from carpool.tools.modelref import ConfiguredModel, resolve, resolve_import
from carpool.tools.outputs import writable_path
from carpool.tools.targets import read_texts, sample_inputs
from carpool.tools.tune import (
    OBJECTIVES,
    STRATEGIES,
    Constraints,
    Param,
    SearchSpace,
    TrialResult,
    Tuner,
)
from carpool.tools.tune_report import (
    base_document,
    base_entry,
    datatype_of,
    recommended_config,
    write_config,
    write_report,
)
from carpool.tools.tune_runners import TUNE_FORMS, InProcessRunner, LoadSpec, ServerRunner
from carpool.tools.tune_trial import MeasureSettings, TrialConfig, measure_trial

DEFAULT_PARAMS = ("max_delay_s=0,0.002,0.01,0.05", "max_batch_size=1,8,32,128")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*$")


def parse_duration(text: str) -> float:
    """``5s``, ``500ms``, ``2m`` or plain seconds, as seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 5s or 500ms")
    scale = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
    return float(match.group(1)) * scale


_TARGET_HELP = (
    "module:attr (a batched callable, a factory taking device or no argument, a class, an "
    "nn.Module, a @carpool.batched function), http://HOST:PORT/v2/models/M (a server "
    "started with --allow-policy-updates; its API key, if any, in CARPOOL_API_KEY), or "
    "nothing with --config FILE --model NAME"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="carpool tune", description=__doc__.split("\n\n")[0])
    p.add_argument("target", metavar="TARGET", nargs="?", help=_TARGET_HELP)
    p.add_argument("--slo-p99-ms", type=float, required=True, help="p99 latency limit (ms)")
    p.add_argument("--out", type=Path, required=True, help="recommended serve config (YAML)")
    p.add_argument("--search", choices=STRATEGIES, default="hill")
    p.add_argument(
        "--param",
        action="append",
        metavar="NAME=V1,V2,...",
        help=f"a searched parameter (repeatable); default {' '.join(DEFAULT_PARAMS)}",
    )
    p.add_argument("--objective", choices=OBJECTIVES, default="throughput")
    p.add_argument("--memory-budget-mb", type=float, help="most resident memory (MiB)")
    p.add_argument(
        "--trial-duration",
        type=parse_duration,
        default=5.0,
        help="longest measurement of a trial (e.g. 5s)",
    )
    p.add_argument("--warmup", type=parse_duration, default=1.0, help="discarded warm-up")
    p.add_argument("--window", type=parse_duration, default=1.0, help="one measured window")
    p.add_argument(
        "--stable-spread",
        type=float,
        default=0.05,
        help="stop a trial when its last windows' throughput spreads less",
    )
    p.add_argument("--stable-windows", type=int, default=3, help="windows the spread spans")
    p.add_argument("--max-windows", type=int, help="default: trial duration / window")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=64, help="closed-loop callers")
    load.add_argument("--rate", type=float, help="open-loop Poisson arrivals (req/s)")
    p.add_argument("--eta", type=int, default=3, help="successive halving keeps 1/eta")
    p.add_argument("--report", type=Path, metavar="DIR", help="write tune.md/.html and plots")
    p.add_argument("--html", type=Path, metavar="FILE", help="write one self-contained HTML report")
    p.add_argument(
        "--config",
        "--model-config",
        dest="model_config",
        type=Path,
        metavar="FILE",
        help="a serve config: without TARGET, tune its model --model in-process; with one, "
        "the entry the tuned fields are set on",
    )
    p.add_argument(
        "--model",
        "--model-name",
        dest="model_name",
        metavar="NAME",
        help="the model's name: an entry of --config, or the served name",
    )
    p.add_argument(
        "--shape",
        help="one item's shape, comma-separated (e.g. 256); --config: every input's "
        "(default: as declared, a variable dim as 16)",
    )
    p.add_argument(
        "--texts",
        type=Path,
        metavar="FILE",
        help="--config's embeddings model: the texts its requests carry, one per line, in "
        "turn (default: carpool bench's one text)",
    )
    p.add_argument("--dtype", default="float32", help="module:attr: the item's NumPy dtype")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str]) -> None:
    """Entry point of ``carpool tune``; exits with the status the module doc lists."""
    args = build_parser().parse_args(argv)
    try:
        code = asyncio.run(run(args))
    except ConfigError as error:
        print(f"carpool tune: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except (httpx.HTTPError, OSError) as error:  # the server to tune is down or failing
        print(f"carpool tune: {args.target}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(code)


def _check_flags(args: argparse.Namespace) -> None:
    """What a run cannot use, refused before the first trial.

    Raises:
        ConfigError: naming the flag.
    """
    for flag, value in (
        ("--window", args.window),
        ("--trial-duration", args.trial_duration),
        ("--stable-spread", args.stable_spread),
        ("--slo-p99-ms", args.slo_p99_ms),
    ):
        if not value > 0:
            raise ConfigError(flag, value, "a number above 0")
    if args.max_windows is not None and args.max_windows < 1:
        raise ConfigError("--max-windows", args.max_windows, "an integer >= 1")
    budget = args.memory_budget_mb
    if budget is not None and not 0 < budget < math.inf:
        raise ConfigError("--memory-budget-mb", budget, "MiB, a finite number above 0")
    writable_path("--out", args.out)
    if args.report is not None:  # a folder: what goes in it must be writable
        writable_path("--report", args.report / "tune.md")
    writable_path("--html", args.html)
    if args.model_config is not None:
        base_entry(args.model_config, args.model_name)


def _server_target(target: str, model_name: str | None) -> tuple[str, str]:
    parts = urlsplit(target)
    segments = [s for s in parts.path.split("/") if s]
    if segments[:2] == ["v2", "models"] and len(segments) >= 3:
        model_name = segments[2]
    elif len(segments) == 1:
        model_name = segments[0]
    if not model_name:
        raise ConfigError("TARGET", target, "http://HOST:PORT/v2/models/NAME (or --model-name)")
    return f"{parts.scheme}://{parts.netloc}", model_name


def _item(args: argparse.Namespace) -> Any:
    if not args.shape:
        raise ConfigError("--shape", None, "one item's shape for a module:attr target (e.g. 256)")
    try:
        shape = _shape(args)
        dtype = np.dtype(args.dtype)
    except (ValueError, TypeError):
        raise ConfigError("--shape/--dtype", (args.shape, args.dtype), "ints and a dtype") from None
    return np.random.default_rng(args.seed).standard_normal(shape).astype(dtype)


def _shape(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(d) for d in str(args.shape).split(",") if d.strip())


def _config_item(args: argparse.Namespace, entry: ConfiguredModel) -> dict[str, Any]:
    """One item of each of the config model's declared inputs."""
    try:
        shape = _shape(args) if args.shape else None
    except ValueError:
        raise ConfigError("--shape", args.shape, "comma-separated ints (e.g. 256)") from None
    rng = np.random.default_rng(args.seed)
    return sample_inputs(entry.runner("tune").inputs, rng, shape=shape)


def _in_process(args: argparse.Namespace, load: LoadSpec) -> InProcessRunner:
    """The runner of a module:attr TARGET, or of ``--config FILE --model NAME``."""
    if args.target is not None:
        _refuse_texts(args, "a module:attr target")
        return InProcessRunner(resolve_import(args.target, TUNE_FORMS), _item(args), load)
    config = None if args.model_config is None else str(args.model_config)
    ref = resolve(None, config=config, model=args.model_name, accepts=TUNE_FORMS)
    assert isinstance(ref, ConfiguredModel)  # no source: the config's model, or an error
    if ref.takes_texts:
        if args.shape:
            raise ConfigError(
                "--shape", args.shape, "none for an embeddings model: its requests are texts"
            )
        return InProcessRunner(ref, read_texts(args.texts), load)
    _refuse_texts(args, f"a {ref.model.kind} model")
    return InProcessRunner(ref, _config_item(args, ref), load)


def _refuse_texts(args: argparse.Namespace, what: str) -> None:
    """``--texts`` is for a config's embeddings model only: anywhere else it would be
    silently ignored."""
    if args.texts is not None:
        raise ConfigError(
            "--texts", str(args.texts), f"only with --config's embeddings model, not {what}"
        )


async def run(args: argparse.Namespace) -> int:
    """Tune as ``args`` say; returns the exit status."""
    _check_flags(args)
    space = SearchSpace(tuple(Param.parse(t) for t in args.param or DEFAULT_PARAMS))
    max_windows = args.max_windows  # 0 is refused as -1 is, not taken for the default
    if max_windows is None:
        max_windows = max(1, round(args.trial_duration / args.window))
    settings = MeasureSettings(
        args.warmup, args.window, args.stable_spread, args.stable_windows, max_windows
    )
    budget = None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)
    constraints = Constraints(args.slo_p99_ms * 1e-3, budget)
    load = LoadSpec(concurrency=args.concurrency, rate_rps=args.rate, seed=args.seed)
    runner: InProcessRunner | ServerRunner
    is_server = args.target is not None and args.target.startswith(("http://", "https://"))
    if is_server:
        url, model = _server_target(args.target, args.model_name)
        from carpool.server.access import API_KEY_ENV

        _refuse_texts(args, "a served model (its requests are KServe rows)")
        runner = ServerRunner(url, model, load, api_key=os.environ.get(API_KEY_ENV))
        await runner.connect()
        label = args.target
    else:
        in_process = runner = _in_process(args, load)
        label = args.target or in_process.source
    print(
        f"carpool tune: {args.search} over {space.size} configs of {', '.join(space.names)}; "
        f"SLO p99 <= {args.slo_p99_ms:g} ms",
        flush=True,
    )

    async def measure(config: TrialConfig, scale: float) -> Any:
        return await measure_trial(runner, config, settings, scale)

    tuner = Tuner(
        space, constraints, measure, objective=args.objective, eta=args.eta, on_result=_progress
    )
    try:
        outcome = await tuner.run(args.search)
        entry = await _entry(args, runner)
    finally:
        await runner.close()
    if args.report is not None:
        path = write_report(outcome, args.report, label)
        print(f"report: {path}")
    if args.html is not None:
        from carpool.tools.report import write_html
        from carpool.tools.report_tune import tune_html

        write_html(args.html, tune_html(outcome, label))
    best = outcome.best
    if best is None:
        print("no trial met the constraints; no config written", file=sys.stderr)
        return 1
    base = None if args.model_config is None else base_document(args.model_config)
    document = recommended_config(entry, best.config.as_dict(), base)
    m = best.measurement
    notes = [
        f"carpool tune {label}: {args.search}, SLO p99 <= {args.slo_p99_ms:g} ms",
        f"best: {best.config.label()}: {best.objective:.1f} "
        f"{'req/s' if args.objective == 'throughput' else 'items/s'}, "
        f"p99 {m.p99_s * 1e3:.2f} ms (trial {best.trial_id} of {len(outcome.results)})",
    ]
    if args.model_config is None:
        notes += _entry_notes(is_server)
    write_config(document, args.out, notes)
    print(f"recommended: {best.config.label()} -> {args.out}")
    return 0


def _progress(r: TrialResult) -> None:
    m = r.measurement
    status = "ok" if r.is_feasible else "; ".join(r.violations)
    print(
        f"  #{r.trial_id:<3} {r.stage:<11} {r.config.label():<40} {r.objective:9.1f}/s "
        f"p99 {m.p99_s * 1e3:8.2f} ms  windows {m.num_windows}  {status}",
        flush=True,
    )


async def _entry(args: argparse.Namespace, runner: InProcessRunner | ServerRunner) -> Any:
    """The base model entry of the recommended config."""
    if args.model_config is not None:
        return base_entry(args.model_config, args.model_name)
    if isinstance(runner, ServerRunner):
        meta = runner.metadata

        def tensors(key: str) -> list[dict[str, Any]]:
            return [
                {"name": t["name"], "datatype": t["datatype"], "shape": t["shape"][1:]}
                for t in meta[key]
            ]

        return {
            "name": runner.model,
            "kind": "python",
            "source": "your_module:your_model",
            "inputs": tensors("inputs"),
            "outputs": tensors("outputs"),
        }
    item = _item(args)
    output = np.asarray(await runner.sample_output())
    name = args.model_name or re.sub(r"[^A-Za-z0-9_.-]", "_", args.target.rsplit(":", 1)[-1])
    return {
        "name": name,
        "kind": "python",
        "source": args.target,
        "inputs": [{"name": "INPUT0", "datatype": datatype_of(item), "shape": list(item.shape)}],
        "outputs": [
            {"name": "OUTPUT0", "datatype": datatype_of(output), "shape": list(output.shape)}
        ],
    }


def _entry_notes(is_server: bool) -> list[str]:
    if is_server:
        return [
            "source is a placeholder: set it to the served model's module:attr",
            "(or pass --model-config with the config the server was started from)",
        ]
    return [
        "carpool serve calls a python model with {input name: array}; a model that",
        "takes a bare array (as tuned here) needs a wrapper, or pass --model-config",
    ]
