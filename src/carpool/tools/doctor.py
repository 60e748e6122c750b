"""``carpool doctor``: what a model does when batched, measured offline (no server).

Four parts, each a pure function over an injected callable (and clock, where time matters):

1. :func:`measure_sweep` (``doctor_sweep``) times batches of 1, 2, 4, ... up to
   ``max_batch`` (warm-up, then repeated calls: median and p90 latency, items/s, peak memory
   growth); :func:`find_knee` and :func:`max_batch_under_budget` turn them into verdicts.
2. :func:`check_invariance` (``doctor_checks``) runs probe items alone and among other
   items (random, large-magnitude, zero, longer neighbours, at several positions) and flags
   outputs that depend on their neighbours or on padding.
3. :func:`measure_lengths` (``doctor_checks``) times uniform vs mixed-length batches and
   suggests bucket edges.
4. ``doctor_report`` renders the text report and the JSON.

:func:`run_doctor` runs all four on a :class:`Target`; :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from carpool.core.replicas import is_async_callable
from carpool.core.stepwise import run_to_end
from carpool.errors import ConfigError, ModelError
from carpool.tools.doctor_checks import (
    Array,
    BatchCall,
    Clock,
    InvarianceVerdict,
    LengthReport,
    Outputs,
    check_invariance,
    make_items,
    measure_lengths,
)
from carpool.tools.doctor_report import machine_info, render_text, write_json
from carpool.tools.doctor_sweep import (
    CudaProbe,
    MemoryProbe,
    RssProbe,
    batch_sizes,
    find_knee,
    max_batch_under_budget,
    measure_sweep,
)
from carpool.tools.doctor_types import DoctorOptions, DoctorReport
from carpool.tools.modelref import (
    MODEL_FORMS,
    ConfiguredModel,
    Form,
    ImportedModel,
    ModuleCall,
    form_of,
    forms_text,
    is_module,
    resolve,
    resolve_import,
    single_input,
)
from carpool.tools.outputs import writable_path

if TYPE_CHECKING:
    from carpool.server.builder import ModelRunner

_MIB = 1024 * 1024


# -- the model, adapted ------------------------------------------------------------------------


def to_outputs(raw: Any, num_items: int) -> Outputs:
    """``raw`` (array, tensor, dict or tuple of them) as ``{name: NumPy array}``, rows checked.

    Raises:
        ModelError: when an output is not an array or does not have ``num_items`` rows.
    """
    if isinstance(raw, Mapping):
        pairs = [(str(k), v) for k, v in raw.items()]
    elif isinstance(raw, tuple | list):
        pairs = [(f"output_{i}", v) for i, v in enumerate(raw)]
    else:
        pairs = [("output", raw)]
    out: Outputs = {}
    for name, value in pairs:
        if hasattr(value, "detach"):  # a torch tensor: no torch import for NumPy models
            value = value.detach()
            if str(value.dtype) == "torch.bfloat16":
                value = value.float()
            value = value.cpu().numpy()
        array = np.asarray(value)
        if array.ndim == 0 or array.shape[0] != num_items:
            raise ModelError(
                f"output {name!r} has shape {array.shape} for a batch of {num_items}: outputs "
                "must align with the inputs along axis 0"
            )
        out[name] = array
    return out


@dataclass(slots=True)
class Target:
    """The model as ``call(batch) -> {name: array}``; ``modules`` are torch modules to inspect."""

    call: BatchCall
    modules: list[Any] = field(default_factory=list)
    device: str = "cpu"


def _torch_modules(obj: Any) -> list[Any]:
    """``obj`` itself if it is an ``nn.Module``, else the modules among its attributes."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    if isinstance(obj, torch.nn.Module):
        return [obj]
    found = [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, torch.nn.Module)]
    return found


# What ``carpool doctor SOURCE`` takes (see carpool.tools.modelref).
DOCTOR_FORMS = (*MODEL_FORMS, Form.BATCHED)


def load_target(
    source: str | Any, *, device: str = "cpu", dtype: str = "float32", input_name: str | None = None
) -> Target:
    """The model ``source`` (``module:attr``, the object itself or an
    :class:`~carpool.tools.modelref.ImportedModel`) as a :class:`Target`.

    A factory (taking ``device``, or no argument) is called once; an ``nn.Module`` runs on
    ``device`` under ``torch.inference_mode()`` on a tensor of ``dtype``; any other callable
    gets the NumPy batch (as ``{input_name: batch}`` when ``input_name`` is given).

    Raises:
        ConfigError: when ``source`` fits none of the forms (the message lists them), cannot
            be imported, or its factory fails.
    """
    if isinstance(source, ImportedModel):
        ref = source
    elif isinstance(source, str):
        ref = resolve_import(source, DOCTOR_FORMS)
    else:
        form = form_of(source)
        name = getattr(source, "__name__", type(source).__name__)
        if form is None or form not in DOCTOR_FORMS:
            raise ConfigError("source", name, forms_text(DOCTOR_FORMS))
        ref = ImportedModel(name, source, form)
    model = _loaded(ref.label, device, lambda: ref.build(device))
    modules = _torch_modules(model)
    if is_module(model):
        module_call = ModuleCall(model, device, dtype, input_name)

        def call_module(batch: Array) -> Outputs:
            return to_outputs(module_call(batch), len(batch))

        return Target(call_module, modules, device)
    if dtype == "bfloat16":
        raise ConfigError("dtype", dtype, "a NumPy dtype for a callable that is not an nn.Module")
    fn = _synchronous(model, "source", ref.label)

    def call_fn(batch: Array) -> Outputs:
        return to_outputs(fn({input_name: batch} if input_name else batch), len(batch))

    return Target(call_fn, modules, device)


def config_target(entry: ConfiguredModel, runner: ModelRunner, device: str) -> Target:
    """The config entry's model as ``carpool serve`` runs it on ``device`` (``runner`` is
    ``entry.runner("doctor")``): its one input gets the batch, its outputs are checked
    against the declared ones.

    Raises:
        ConfigError: naming ``models[i].<field>``: several inputs, a ragged or BYTES one,
            an async model, or a model that cannot be loaded on ``device``.
    """
    from carpool.server.outputs import check_outputs

    spec = single_input(entry, runner.inputs, "doctor")
    model = _loaded(entry.label, device, lambda: runner.fn_factory(device))
    where = f"{entry.key}.source"
    fn = _synchronous(model, where, entry.model.source, entry.file)
    name, outputs = spec.name, runner.outputs

    def call(batch: Array) -> Outputs:
        return to_outputs(check_outputs(fn({name: batch}), outputs), len(batch))

    return Target(call, _torch_modules(model), device)


def _loaded(label: str, device: str, load: Callable[[], Any]) -> Any:
    """``load()``; an error that is not a ConfigError is the model's own: one line, exit 2."""
    try:
        return load()
    except ConfigError:
        raise
    except Exception as error:
        raise ModelError(f"could not load {label!r} on {device!r}: {error!r}") from error


def _synchronous(
    fn: Callable[[Any], Any], field_name: str, value: str, file: str | None = None
) -> Callable[[Any], Any]:
    if is_async_callable(fn):
        expected = "a synchronous batched callable: carpool doctor times direct calls"
        raise ConfigError(field_name, value, expected, file=file)

    def called(batch: Any) -> Any:
        return run_to_end(fn(batch))  # a model in steps (carpool.core.stepwise) to its end

    return called


# -- all of it ------------------------------------------------------------------------------------


def _neighbours(
    options: DoctorOptions, rng: np.random.Generator, probe_shape: tuple[int, ...]
) -> dict[str, Callable[[int], Array]]:
    dtype = options.dtype

    def random(n: int) -> Array:
        return make_items(rng, n, probe_shape, dtype)

    kinds: dict[str, Callable[[int], Array]] = {"random": random}
    if dtype == "bfloat16" or np.issubdtype(np.dtype(dtype), np.floating):
        kinds["large"] = lambda n: random(n) * np.asarray(1e3, dtype=random(1).dtype)
    kinds["zeros"] = lambda n: np.zeros_like(random(n))
    axis = options.variable_axis
    if axis is not None:
        longest = max([*options.lengths, 2 * probe_shape[axis]])
        long_shape = options.item_shape(longest)
        kinds["longer"] = lambda n: make_items(rng, n, long_shape, dtype)
    return kinds


def run_invariance(
    target: Target, options: DoctorOptions, rng: np.random.Generator
) -> InvarianceVerdict:
    """Part 2 on ``target``: probes at the shortest length, padded to the longer ones."""
    axis = options.variable_axis
    probe_length = min(options.lengths) if options.lengths else None
    probe_shape = options.item_shape(probe_length)
    pad_lengths: list[int] = []
    if axis is not None:
        base = probe_shape[axis]
        pad_lengths = sorted({*options.lengths, base + max(1, base // 2), 2 * base} - {base})
    probes = list(make_items(rng, options.num_probes, probe_shape, options.dtype))
    sizes = sorted({min(8, options.max_batch), options.max_batch})
    try:
        return check_invariance(
            target.call,
            probes,
            _neighbours(options, rng, probe_shape),
            sizes,
            rtol=options.rtol,
            modules=target.modules,
            pad_axis=axis,
            pad_lengths=pad_lengths,
        )
    except Exception as error:
        raise ModelError(
            f"the model raised during the invariance check: {type(error).__name__}: {error}"
        ) from error


def run_doctor(
    target: Target,
    options: DoctorOptions,
    *,
    source: str = "",
    clock: Clock = time.perf_counter,
    memory: MemoryProbe | None = None,
) -> DoctorReport:
    """Run the four parts of the doctor on ``target``.

    ``memory`` defaults to peak CUDA allocation on a ``cuda`` device, else peak RSS growth.

    Raises:
        ModelError: when the model raises on a batch it should take.
    """
    from carpool.tools.machine import model_kernels

    rng = np.random.default_rng(options.seed)
    is_cuda = target.device.startswith("cuda")
    if memory is None:
        memory = CudaProbe(target.device) if is_cuda else RssProbe()
    sweep_shape = options.item_shape(options.sweep_length)
    sweep = measure_sweep(
        target.call,
        lambda n: make_items(rng, n, sweep_shape, options.dtype),
        batch_sizes(options.max_batch),
        repeats=options.repeats,
        warmup=options.warmup,
        clock=clock,
        memory=memory,
    )
    measured = [t for t in sweep if t.error is None]
    knee = find_knee([(t.batch_size, t.items_per_s) for t in measured], options.knee_gain)
    budget = options.memory_budget_bytes
    mem_points = [(t.batch_size, t.memory_bytes) for t in measured if t.memory_bytes is not None]
    verdict = max_batch_under_budget(mem_points, budget) if budget is not None else None
    invariance = run_invariance(target, options, rng)
    lengths: LengthReport | None = None
    axis = options.variable_axis
    if options.lengths and axis is not None:
        lengths = measure_lengths(
            target.call,
            lambda n: make_items(rng, 1, options.item_shape(n), options.dtype)[0],
            options.lengths,
            min(options.max_batch, options.length_batch_size),
            axis=axis,
            repeats=options.repeats,
            warmup=options.warmup,
            rng=rng,
            clock=clock,
        )
    return DoctorReport(
        source=source,
        options=options,
        machine={**machine_info(), **model_kernels(target.modules)},
        memory_kind="cuda" if is_cuda else "rss",
        sweep=sweep,
        knee=knee,
        memory=verdict,
        invariance=invariance,
        lengths=lengths,
    )


# -- command line ---------------------------------------------------------------------------------


def _ints(text: str, field_name: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise ConfigError(field_name, text, "comma-separated integers, e.g. 256 or -1,64") from None


def _glue_shape(argv: list[str]) -> list[str]:
    """``--shape -1,64`` as ``--shape=-1,64``: argparse reads ``-1,64`` as an option."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--shape" and arg.startswith("-"):
            out[-1] = f"--shape={arg}"
        else:
            out.append(arg)
    return out


_SOURCE_HELP = (
    "module:attr naming a batched callable, a factory taking device, a zero-argument factory "
    "or class (as a serve torch source; it returns a batched callable or an nn.Module), an "
    "nn.Module or a @carpool.batched function; or leave it out and give --config and --model"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="carpool doctor",
        description="Measure a batched model offline: throughput knee, memory per batch size, "
        "batch invariance and input-length variance.",
    )
    p.add_argument("source", nargs="?", metavar="SOURCE", help=_SOURCE_HELP)
    p.add_argument(
        "--config", metavar="FILE", help="a carpool serve config: measure its model --model"
    )
    p.add_argument("--model", metavar="NAME", help="the model's name in --config")
    p.add_argument(
        "--shape", help="one item's shape, e.g. 256 or -1,64 (--config: the model's input's)"
    )
    p.add_argument("--dtype", help="input dtype (default float32; --config: the input's)")
    p.add_argument("--max-batch", type=int, default=128, help="largest batch size to measure")
    p.add_argument("--json", dest="json_path", help="write every number and verdict here")
    p.add_argument(
        "--device", help="device for factories and nn.Modules (default cpu; --config: its device)"
    )
    p.add_argument("--repeats", type=int, default=15, help="timed calls per batch size")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per batch size first")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--memory-budget-mb", type=float, help="memory for one batch's working set")
    p.add_argument("--lengths", help="lengths of the variable dim, e.g. 8,32,128,256")
    p.add_argument("--pad-axis", type=int, help="item axis that is zero-padded (0 = first)")
    p.add_argument("--probes", type=int, default=3, help="probe items of the invariance check")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: by dtype, f32 1e-5)")
    p.add_argument("--knee-gain", type=float, default=1.3, help="min throughput gain per doubling")
    p.add_argument("--input-name", help="pass {NAME: batch} instead of the bare batch")
    p.add_argument("--threads", type=int, help="torch.set_num_threads before measuring")
    p.add_argument("--strict", action="store_true", help="exit 1 when the invariance check fails")
    return p


# DoctorOptions' fields by the flags that set them.
_FLAGS = {
    "shape": "--shape", "dtype": "--dtype", "max_batch": "--max-batch", "rtol": "--rtol",
    "repeats": "--repeats", "warmup": "--warmup", "lengths": "--lengths",
    "pad_axis": "--pad-axis", "knee_gain": "--knee-gain", "num_probes": "--probes",
    "memory_budget_bytes": "--memory-budget-mb",
}  # fmt: skip


def options_from_args(
    args: argparse.Namespace,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> DoctorOptions:
    """:class:`DoctorOptions` from parsed command-line arguments; ``shape``, ``dtype`` and
    ``device`` stand where the flag is not given (a config model's input and device).

    Raises:
        ConfigError: on the first invalid option.
    """
    if args.shape is not None:
        shape = _ints(args.shape, "shape")
    if shape is None:
        raise ConfigError("shape", None, "--shape: one item's shape, e.g. 256 or -1,64")
    budget = args.memory_budget_mb
    if budget is not None and not 0 < budget < math.inf:
        raise ConfigError("--memory-budget-mb", budget, "MiB, a finite number above 0")
    try:
        return DoctorOptions(
            shape=shape,
            dtype=args.dtype or dtype,
            max_batch=args.max_batch,
            device=args.device or device,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
            memory_budget_bytes=None if budget is None else int(budget * _MIB),
            lengths=_ints(args.lengths, "lengths") if args.lengths else (),
            pad_axis=args.pad_axis,
            num_probes=args.probes,
            rtol=args.rtol,
            knee_gain=args.knee_gain,
            input_name=args.input_name,
        )
    except ConfigError as error:  # named as the command line names it
        flag = _FLAGS.get(error.field)
        if flag is None:
            raise
        raise ConfigError(flag, error.value, error.expected) from None


def _prepare(args: argparse.Namespace) -> tuple[str, DoctorOptions, Callable[[], Target]]:
    """(the model's label, the options, how to load it): the model is named, the options
    checked, the model not yet loaded."""
    ref = resolve(args.source, config=args.config, model=args.model, accepts=DOCTOR_FORMS)
    if isinstance(ref, ImportedModel):
        options = options_from_args(args)

        def load() -> Target:
            device, dtype = options.device, options.dtype
            return load_target(ref, device=device, dtype=dtype, input_name=args.input_name)

        return ref.label, options, load
    from carpool.server.kserve.tensors import DATATYPES

    if args.input_name is not None:
        expected = "nothing with --config: the config names the model's input"
        raise ConfigError("input_name", args.input_name, expected)
    runner = ref.runner("doctor")
    spec = single_input(ref, runner.inputs, "doctor")
    options = options_from_args(
        args,
        shape=spec.shape,
        dtype=DATATYPES[spec.datatype].name,
        device=ref.model.replica_devices()[0],
    )
    return ref.label, options, lambda: config_target(ref, runner, options.device)


def main(argv: list[str] | None = None) -> None:
    """``carpool doctor SOURCE --shape ... [--json OUT]``, or ``carpool doctor --config FILE
    --model NAME``; exits 2 on a bad option or model."""
    args = _parser().parse_args(_glue_shape(sys.argv[1:] if argv is None else argv))
    try:
        label, options, load = _prepare(args)
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError("threads", args.threads, "an integer >= 1")
            import torch

            torch.set_num_threads(args.threads)
        json_path = writable_path("json", args.json_path)
        report = run_doctor(load(), options, source=label)
    except (ConfigError, ModelError) as error:
        print(f"carpool doctor: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(render_text(report))
    if json_path is not None:
        write_json(report, json_path)
        print(f"\nJSON written to {json_path}")
    if args.strict and not report.invariance.is_passed:
        raise SystemExit(1)
