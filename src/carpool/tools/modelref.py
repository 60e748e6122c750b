"""How ``carpool doctor``, ``tune`` and ``bench`` name a model: every form, in one place.

A model is named by ``SOURCE`` (``module:attr``) or by ``--config FILE --model NAME``::

    module:attr naming                      the tool builds the model as
    --------------------------------------  -------------------------------------------
    a batched callable                      itself (the batch along axis 0 in, outputs
                                            aligned with it out)
    a factory whose one parameter is        factory(device), once per device
      named device (carpool.models.python)
    a zero-argument factory, or a class     factory(), as ``carpool serve`` builds a
      (serve's torch module:factory)        torch module:factory
    an nn.Module instance                   itself, moved to the device
    a @carpool.batched function             (tune, bench) its function and its policy
    a carpool.Batcher                       (bench) itself

    --config FILE --model NAME              the config entry NAME, built by serve's own
                                            code (carpool.config, carpool.server.builder)

A factory returns a batched callable or an ``nn.Module``; an ``nn.Module`` is called on a
torch tensor under ``torch.inference_mode()`` (:class:`ModuleCall`). :func:`resolve` turns
what the command line gave into an :class:`ImportedModel` or a :class:`ConfiguredModel`;
a name that fits no form is a :class:`~carpool.errors.ConfigError` listing the forms.
"""

from __future__ import annotations

import enum
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from carpool.core.batcher import Batcher
from carpool.core.decorator import BatchedFunction
from carpool.errors import ConfigError
from carpool.models._source import build_with, import_ref, is_import_ref
from carpool.models.python import is_factory

if TYPE_CHECKING:
    from carpool.config import ModelConfig
    from carpool.server.builder import ModelRunner
    from carpool.server.repository import ServedModel, TensorSpec

_T = TypeVar("_T")


class Form(enum.Enum):
    """What a ``module:attr`` names; the value is how error messages describe it."""

    CALLABLE = "module:attr naming a batched callable (the batch along axis 0 in, outputs out)"
    DEVICE_FACTORY = "module:attr naming a factory whose one parameter is named device"
    FACTORY = "module:attr naming a zero-argument factory or class (as serve's torch source)"
    MODULE = "module:attr naming an nn.Module instance"
    BATCHED = "module:attr naming a @carpool.batched function"
    BATCHER = "module:attr naming a carpool.Batcher"


# What every in-process command takes; doctor and tune add BATCHED, bench BATCHED and BATCHER.
MODEL_FORMS = (Form.CALLABLE, Form.DEVICE_FACTORY, Form.FACTORY, Form.MODULE)
CONFIG_FORM = (
    "--config FILE --model NAME (a model of a carpool serve config, built as serve builds "
    "it: also a TorchScript, .pt2 or .onnx file)"
)
FACTORY_RESULT = "a factory returns a batched callable or an nn.Module"
_NAMING = "module:attr naming "


def forms_text(accepts: tuple[Form, ...]) -> str:
    """The forms ``accepts``, and the config form, as one line for an error message."""
    forms = [form.value for form in accepts]
    return f"one of: {'; '.join(forms)}; or {CONFIG_FORM}; {FACTORY_RESULT}"


@dataclass(frozen=True, slots=True)
class ImportedModel:
    """What ``source`` (``module:attr``) names, and which form that is."""

    source: str
    obj: Any
    form: Form

    @property
    def label(self) -> str:
        return self.source

    def build(self, device: str) -> Any:
        """The model on ``device``: a batched callable or an ``nn.Module`` (moved there).

        Raises:
            ConfigError: on field ``source`` when a factory raises or returns neither; on
                field ``device`` when torch cannot place a module there.
        """
        obj = self.obj
        if self.form is Form.DEVICE_FACTORY:
            obj = build_with(self.source, obj, device)
        elif self.form is Form.FACTORY:
            obj = build_with(self.source, obj)
        elif self.form is Form.BATCHED:
            obj = obj.__wrapped__
        if is_module(obj):
            from carpool.models.torch import torch_device

            return obj.to(torch_device(device))
        if not callable(obj):
            raise ConfigError(
                "source",
                self.source,
                f"{FACTORY_RESULT}; it returned a value of type {type(obj).__name__}",
            )
        return obj

    def batched_callable(self, device: str, dtype: str | None = None) -> Callable[[Any], Any]:
        """:meth:`build`, with an ``nn.Module`` wrapped to take and return NumPy arrays."""
        model = self.build(device)
        if is_module(model):
            return ModuleCall(model, device, dtype)
        fn: Callable[[Any], Any] = model
        return fn


@dataclass(frozen=True, slots=True)
class ConfiguredModel:
    """The entry ``models[index]`` of the serve config ``file``."""

    model: ModelConfig
    file: str
    index: int

    @property
    def key(self) -> str:
        return f"models[{self.index}]"

    @property
    def label(self) -> str:
        return f"--config {self.file} --model {self.model.name}"

    @property
    def takes_texts(self) -> bool:
        """An embeddings model: its batcher's requests are texts' token ids."""
        return self.model.kind == "embeddings"

    def check_batched(self, command: str, *, texts: bool = False) -> None:
        """Refuse a model the ``command`` cannot call on tensor batches (``texts``: the
        command can drive an embeddings model's batcher with tokenized texts).

        Raises:
            ConfigError: on ``models[i].kind`` for a generation model, and for an
                embeddings model unless ``texts``.
        """
        from carpool.server.builder import BATCHED_KINDS

        kind = self.model.kind
        if kind not in BATCHED_KINDS and not (texts and self.takes_texts):
            protocol = "openai-embeddings" if kind == "embeddings" else "openai-completions"
            raise ConfigError(
                f"{self.key}.kind",
                kind,
                f"a model carpool {command} runs on tensor batches ({', '.join(BATCHED_KINDS)});"
                f" this {kind} model takes text: serve it and run carpool bench on its URL "
                f"with --protocol {protocol}",
                file=self.file,
            )

    def runner(self, command: str) -> ModelRunner:
        """The model's runner, as ``carpool serve`` builds it (no batcher).

        Raises:
            ConfigError: naming ``models[i].<field>`` and the file (see :meth:`check_batched`).
        """
        from carpool.server.builder import build_runner

        self.check_batched(command)
        return self._keyed(lambda: build_runner(self.model, key=self.key, file=self.file))

    def served(
        self,
        command: str,
        *,
        num_replicas: int | None = None,
        buffer_pool: bool | None = None,
        texts: bool = False,
    ) -> ServedModel:
        """The model as ``carpool serve`` serves it: its batcher, policy and devices;
        ``num_replicas`` replicas instead of the config's (its devices taken in turn), and
        ``buffer_pool`` instead of the config's when given; ``texts``: an embeddings model
        too (its service tokenizes, its batcher takes the token ids).

        Raises:
            ConfigError: naming ``models[i].<field>`` and the file (see :meth:`check_batched`).
        """
        from carpool.server.builder import build_model

        self.check_batched(command, texts=texts)
        model = self.model
        if num_replicas is not None:
            devices = model.replica_devices()
            placed = [devices[i % len(devices)] for i in range(num_replicas)]
            model = model.model_copy(update={"devices": placed, "num_replicas": None})
        if buffer_pool is not None:
            model = model.model_copy(update={"buffer_pool": buffer_pool})
        return self._keyed(lambda: build_model(model, key=self.key, file=self.file))

    def _keyed(self, build: Callable[[], _T]) -> _T:
        from carpool.server.builder import keyed_error

        try:
            return build()
        except ConfigError as error:
            if error.file is not None:
                raise
            raise keyed_error(error, self.key, self.file) from error


ModelRef = ImportedModel | ConfiguredModel


def resolve(
    source: str | None,
    *,
    config: str | None = None,
    model: str | None = None,
    accepts: tuple[Form, ...] = MODEL_FORMS,
) -> ModelRef:
    """The model named by ``source`` or by ``config`` and ``model`` (see the module doc).

    Raises:
        ConfigError: both or neither given; a source that fits none of ``accepts`` (the
            message lists them); a module that cannot be imported; a config that does not
            load or has no model ``model`` (the message lists its models).
    """
    if config is not None:
        if source is not None:
            raise ConfigError("source", source, f"either SOURCE or {CONFIG_FORM}, not both")
        return resolve_config(config, model)
    if source is None:
        raise ConfigError("source", None, forms_text(accepts))
    if model is not None:
        raise ConfigError("--model", model, "--config FILE too: --model names a model of it")
    return resolve_import(source, accepts)


def resolve_import(source: str, accepts: tuple[Form, ...] = MODEL_FORMS) -> ImportedModel:
    """What ``source`` (``module:attr``) names, in one of ``accepts``.

    Raises:
        ConfigError: on field ``source``, listing the forms, when it fits none of them;
            saying why when the module cannot be imported or lacks the name.
    """
    if not is_import_ref(source):
        raise ConfigError("source", source, forms_text(accepts))
    obj = import_ref(source)
    form = form_of(obj)
    if form is None or form not in accepts:
        what = (
            f"a value of type {type(obj).__name__}"
            if form is None
            else form.value.removeprefix(_NAMING)
        )
        raise ConfigError("source", source, f"{forms_text(accepts)}; it names {what}")
    return ImportedModel(source, obj, form)


def form_of(obj: Any) -> Form | None:
    """The form ``obj`` has, or None when it has none (it is not callable)."""
    if isinstance(obj, BatchedFunction):
        return Form.BATCHED
    if isinstance(obj, Batcher):
        return Form.BATCHER
    if is_module(obj):
        return Form.MODULE
    if not callable(obj):
        return None
    if is_factory(obj):
        return Form.DEVICE_FACTORY
    if _takes_no_arguments(obj):
        return Form.FACTORY
    return Form.CALLABLE


def _takes_no_arguments(obj: Any) -> bool:
    """Whether ``obj()`` is a complete call: every parameter has a default (a class: its
    ``__init__``'s). A batched callable needs its batch; one taking ``*args``, or whose
    signature cannot be read (a builtin, a ufunc), is taken as batched."""
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.kind is not inspect.Parameter.VAR_POSITIONAL
        and (p.default is not inspect.Parameter.empty or p.kind is inspect.Parameter.VAR_KEYWORD)
        for p in parameters
    )


def is_module(obj: Any) -> bool:
    """Whether ``obj`` is a torch ``nn.Module`` (torch is not imported to tell)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def resolve_config(file: str, name: str | None) -> ConfiguredModel:
    """The model ``name`` of the serve config ``file``, read as ``carpool serve`` reads it;
    the file's folder goes first on ``sys.path``, as for serve, so that its ``module:attr``
    sources import.

    Raises:
        ConfigError: what :func:`~carpool.config.load_config` raises; on ``--model`` when
            ``name`` is missing or not in the file, listing the file's models.
    """
    from carpool.config import load_config

    config = load_config(file)
    names = [m.name for m in config.models]
    if name not in names:
        expected = f"the name of a model in the config: one of {names}"
        raise ConfigError("--model", name, expected, file=file)
    folder = str(Path(file).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    index = names.index(name)
    return ConfiguredModel(config.models[index], file, index)


def single_input(
    entry: ConfiguredModel, inputs: tuple[TensorSpec, ...], command: str
) -> TensorSpec:
    """The one input of ``entry`` that ``command`` drives with a NumPy batch.

    Raises:
        ConfigError: on ``models[i].inputs`` for several inputs, a ragged one or BYTES.
    """
    names = [spec.name for spec in inputs]
    if len(inputs) != 1:
        why = f"one input: carpool {command} sweeps one tensor; this model takes {names}"
    elif inputs[0].ragged:
        why = f"an input that is not ragged: carpool {command} sends padded NumPy batches"
    elif inputs[0].datatype == "BYTES":
        why = f"a numeric input: carpool {command} makes random numbers, not BYTES"
    else:
        return inputs[0]
    raise ConfigError(f"{entry.key}.inputs", names, why, file=entry.file)


class ModuleCall:
    """An ``nn.Module`` as a batched callable over NumPy: the batch (or ``{input_name:
    batch}``) goes in as a tensor on ``device`` (cast to ``dtype`` when given) under
    ``torch.inference_mode()``; tensors come back as NumPy arrays, in the structure the
    module returned (a tensor, a tuple or list, a dict). The module is run as it is
    (training mode included: ``carpool doctor`` flags what that does to batching)."""

    def __init__(
        self, module: Any, device: str, dtype: str | None = None, input_name: str | None = None
    ) -> None:
        import torch

        self._torch = torch
        self.module = module
        self.device = device
        self.dtype = getattr(torch, dtype) if dtype is not None else None
        self.input_name = input_name

    def __call__(self, batch: Any) -> Any:
        torch = self._torch
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(batch)).to(self.device, self.dtype)
            raw = self.module(**{self.input_name: x}) if self.input_name else self.module(x)
            return _to_numpy(raw)


def _to_numpy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _to_numpy(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_to_numpy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    if hasattr(value, "detach"):
        value = value.detach()
        if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            value = value.float()
        return value.cpu().numpy()
    return value
