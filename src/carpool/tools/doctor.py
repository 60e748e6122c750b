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
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carpool.errors import ConfigError, ModelError
from carpool.models._source import import_ref
from carpool.models.python import is_factory
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
from carpool.tools.doctor_sweep import (
    BatchTiming,
    CudaProbe,
    KneeVerdict,
    MemoryProbe,
    MemoryVerdict,
    RssProbe,
    batch_sizes,
    find_knee,
    max_batch_under_budget,
    measure_sweep,
)
from carpool.tools.outputs import writable_path

_MIB = 1024 * 1024


# -- options ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What to measure. ``shape`` is one item's shape; ``-1`` marks the variable dim."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    max_batch: int = 128
    device: str = "cpu"
    repeats: int = 15
    warmup: int = 3
    seed: int = 0
    memory_budget_bytes: int | None = None
    lengths: tuple[int, ...] = ()
    pad_axis: int | None = None
    num_probes: int = 3
    rtol: float | None = None
    knee_gain: float = 1.3
    input_name: str | None = None
    length_batch_size: int = 16

    def __post_init__(self) -> None:
        if not self.shape or any(d == 0 or d < -1 for d in self.shape):
            raise ConfigError("shape", self.shape, "positive dims, with -1 for a variable one")
        if sum(d == -1 for d in self.shape) > 1:
            raise ConfigError("shape", self.shape, "at most one variable (-1) dim")
        if self.dtype != "bfloat16":
            try:
                np.dtype(self.dtype)
            except TypeError:
                raise ConfigError("dtype", self.dtype, "a dtype name such as float32") from None
        if self.max_batch < 1:
            raise ConfigError("max_batch", self.max_batch, "an integer >= 1")
        if self.rtol is not None and not self.rtol >= 0:
            raise ConfigError("rtol", self.rtol, "a tolerance >= 0")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError("repeats", (self.repeats, self.warmup), "repeats >= 1, warmup >= 0")
        if any(n < 1 for n in self.lengths):
            raise ConfigError("lengths", self.lengths, "positive lengths")
        if self.lengths and self.variable_axis is None:
            raise ConfigError("lengths", self.lengths, "a --shape with a -1 dim or a --pad-axis")
        if -1 in self.shape and not self.lengths:
            raise ConfigError("lengths", self.lengths, "--lengths when --shape has a -1 dim")
        if self.pad_axis is not None and not 0 <= self.pad_axis < len(self.shape):
            raise ConfigError("pad_axis", self.pad_axis, f"an item axis in [0, {len(self.shape)})")
        if self.knee_gain <= 1.0:
            raise ConfigError("knee_gain", self.knee_gain, "a throughput gain > 1.0")
        if self.num_probes < 1:
            raise ConfigError("num_probes", self.num_probes, "an integer >= 1")

    @property
    def variable_axis(self) -> int | None:
        """The item axis whose length varies: the ``-1`` dim, else ``pad_axis``."""
        return self.shape.index(-1) if -1 in self.shape else self.pad_axis

    def item_shape(self, length: int | None = None) -> tuple[int, ...]:
        """One item's concrete shape, with the variable axis set to ``length`` if given."""
        axis = self.variable_axis
        dims = list(self.shape)
        if axis is not None and (length is not None or dims[axis] == -1):
            dims[axis] = length if length is not None else max(self.lengths)
        return tuple(dims)

    @property
    def sweep_length(self) -> int | None:
        """The length the sweep runs at: the longest one (worst case for memory and time)."""
        return max(self.lengths) if self.lengths else None


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


def load_target(
    source: str | Any, *, device: str = "cpu", dtype: str = "float32", input_name: str | None = None
) -> Target:
    """The model ``source`` (``module:attr`` or the object itself) as a :class:`Target`.

    A ``device`` factory (see :mod:`carpool.models.python`) is called with ``device``; an
    ``nn.Module`` runs under ``torch.inference_mode()`` on a tensor on ``device``; any other
    callable gets the NumPy batch (as ``{input_name: batch}`` when ``input_name`` is given).

    Raises:
        ConfigError: when ``source`` cannot be imported or is not callable.
    """
    obj = import_ref(source) if isinstance(source, str) else source
    if not callable(obj):
        raise ConfigError("source", source, f"a callable or a factory, not {type(obj).__name__}")
    torch = sys.modules.get("torch")
    try:
        if is_factory(obj):
            obj = obj(device)
            torch = sys.modules.get("torch")  # a factory may be what imports it
        module = obj.to(device) if torch is not None and isinstance(obj, torch.nn.Module) else None
    except Exception as error:  # the model's own failure: one line, exit 2
        raise ModelError(f"could not load {source!r} on {device!r}: {error!r}") from error
    modules = _torch_modules(obj)
    if module is not None and torch is not None:
        torch_dtype = getattr(torch, dtype)

        def call_module(batch: Array) -> Outputs:
            with torch.inference_mode():
                x = torch.from_numpy(np.ascontiguousarray(batch)).to(device, torch_dtype)
                feed = {input_name: x} if input_name else None
                raw = module(**feed) if feed else module(x)
                return to_outputs(raw, len(batch))

        return Target(call_module, modules, device)
    if dtype == "bfloat16":
        raise ConfigError("dtype", dtype, "a NumPy dtype for a callable that is not an nn.Module")
    fn = obj

    def call_fn(batch: Array) -> Outputs:
        return to_outputs(fn({input_name: batch} if input_name else batch), len(batch))

    return Target(call_fn, modules, device)


# -- all of it ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """Everything ``carpool doctor`` measured and concluded about one model."""

    source: str
    options: DoctorOptions
    machine: dict[str, Any]
    memory_kind: str  # rss | cuda
    sweep: list[BatchTiming]
    knee: KneeVerdict
    memory: MemoryVerdict | None
    invariance: InvarianceVerdict
    lengths: LengthReport | None


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
    from carpool.tools.doctor_report import machine_info

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
        machine=machine_info(),
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="carpool doctor",
        description="Measure a batched model offline: throughput knee, memory per batch size, "
        "batch invariance and input-length variance.",
    )
    p.add_argument("source", help="module:attr: a batched callable, a device factory, an nn.Module")
    p.add_argument("--shape", required=True, help="one item's shape, e.g. 256 or -1,64")
    p.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    p.add_argument("--max-batch", type=int, default=128, help="largest batch size to measure")
    p.add_argument("--json", dest="json_path", help="write every number and verdict here")
    p.add_argument("--device", default="cpu", help="device for factories and nn.Modules")
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


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    """:class:`DoctorOptions` from parsed command-line arguments.

    Raises:
        ConfigError: on the first invalid option.
    """
    budget = args.memory_budget_mb
    return DoctorOptions(
        shape=_ints(args.shape, "shape"),
        dtype=args.dtype,
        max_batch=args.max_batch,
        device=args.device,
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


def main(argv: list[str] | None = None) -> None:
    """``carpool doctor SOURCE --shape ... [--json OUT]``; exits 2 on a bad option or model."""
    from carpool.tools.doctor_report import render_text, write_json

    args = _parser().parse_args(_glue_shape(sys.argv[1:] if argv is None else argv))
    try:
        options = options_from_args(args)
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError("threads", args.threads, "an integer >= 1")
            import torch

            torch.set_num_threads(args.threads)
        json_path = writable_path("json", args.json_path)
        target = load_target(
            args.source, device=options.device, dtype=options.dtype, input_name=args.input_name
        )
        report = run_doctor(target, options, source=args.source)
    except (ConfigError, ModelError) as error:
        print(f"carpool doctor: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(render_text(report))
    if json_path is not None:
        write_json(report, json_path)
        print(f"\nJSON written to {json_path}")
    if args.strict and not report.invariance.is_passed:
        raise SystemExit(1)
