"""Served models built from a :class:`~carpool.config.ServeConfig`: one batcher per
model, or one generation engine."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.config import GENERATION_FIELDS, ModelConfig, ServeConfig, TensorConfig
from carpool.core.batcher import Batcher
from carpool.core.collate import RaggedDictCollator
from carpool.core.ray_cluster import connect
from carpool.core.telemetry import MemoryProbe
from carpool.errors import ConfigError
from carpool.generation.build import GenerationSettings
from carpool.server.classification import read_labels
from carpool.server.kserve.tensors import DATATYPES
from carpool.server.outputs import checking_outputs
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

if TYPE_CHECKING:
    from carpool.models.onnx import FileTensor, TensorInfo

PLATFORMS = {"python": "python", "torch": "pytorch", "onnx": "onnxruntime"}


def build_repository(config: ServeConfig, *, file: str | None = None) -> ModelRepository:
    """A repository serving every model ``config`` lists (nothing starts until ``start``).

    Python ``module:attr`` sources and torch ``module:factory`` sources are imported here;
    weights load on each replica's thread when the batchers start.

    Raises:
        ConfigError: naming ``models[i].<key>`` (and ``file`` when given) when a model
            cannot be built: a source that does not import, an unreadable ONNX file.
    """
    if config.ray is not None and any(m.executor == "ray" for m in config.models):
        try:
            connect(config.ray.address, config.ray.namespace, config.ray.runtime_env)
        except ConfigError as error:
            raise ConfigError(error.field, error.value, error.expected, file=file) from error
    models = []
    for i, model in enumerate(config.models):
        try:
            models.append(build_model(model, key=f"models[{i}]", file=file))
        except ConfigError as error:
            if error.file is not None:
                raise
            raise keyed_error(error, f"models[{i}]", file) from error
    return ModelRepository(models)


def keyed_error(error: ConfigError, key: str, file: str | None) -> ConfigError:
    """``error`` with its field under the model's ``key`` (``models[i]``), in ``file``."""
    return ConfigError(f"{key}.{error.field}", error.value, error.expected, file=file)


def build_model(
    model: ModelConfig, *, key: str | None = None, file: str | None = None
) -> ServedModel:
    """One served model. Raises :class:`ConfigError` naming the model's key that failed.

    With ``key`` (``models[i]``), a :class:`ConfigError` raised as a replica loads the
    model (a bad device, a file or factory that fails) names ``key.<field>`` and ``file``.
    An output's ``label_filename`` is read here, relative to ``file``'s folder (else the
    working one).
    """
    if model.kind == "embeddings":
        from carpool.server.embeddings import EmbeddingService

        service = EmbeddingService(
            model.name,
            model.source,
            model.policy(),
            devices=model.replica_devices(),
            dtype=model.dtype or "float32",
            quantization=model.quantization,
            max_inputs=model.max_inputs,
            executor=model.executor or EmbeddingService.DEFAULT_EXECUTOR,
            buffer_pool=model.buffer_pool,
            buffer_pool_mb=model.buffer_pool_mb,
        )
        return ServedModel.of_embeddings(service)
    if model.kind == "generation":
        from carpool.server.generation import GenerationService

        settings = generation_settings(model)
        return ServedModel.of_generation(
            GenerationService.from_folder(model.name, model.source, settings)
        )
    runner = build_runner(model, key=key, file=file)
    inputs, outputs = runner.inputs, runner.outputs
    factory: Callable[[str], Any] = checking_outputs(runner.fn_factory, outputs)
    if model.executor in ("process", "ray"):
        factory = ConfiguredFactory(model, key, file)  # picklable, built again in each child
    batcher = Batcher(
        fn_factory=factory,
        policy=model.policy(),
        name=model.name,
        devices=model.replica_devices(),
        collate=_collator(inputs),
        executor=model.executor or "auto",
        memory_probe=_memory_probe(model),
        replica_cpus=model.replica_cpus,
        buffer_pool=model.buffer_pool,
        buffer_pool_mb=model.buffer_pool_mb,
        ray_resources=model.ray_resources,
        max_restarts=model.max_restarts,
        ray_placement=model.ray_placement.model_dump() if model.ray_placement else None,
    )
    return ServedModel(
        name=model.name,
        version=model.version,
        platform=PLATFORMS[model.kind],
        inputs=inputs,
        outputs=outputs,
        batcher=batcher,
    )


BATCHED_KINDS = ("python", "torch", "onnx")  # the kinds build_runner builds


@dataclass(frozen=True, slots=True)
class ConfiguredFactory:
    """A model's factory as its config describes it, picklable: how ``executor: process``
    (or ``ray``) builds the model (checking its outputs) in each replica's process (or
    actor)."""

    model: ModelConfig
    key: str | None
    file: str | None

    def __call__(self, device: str) -> Any:
        runner = build_runner(self.model, key=self.key, file=self.file)
        return checking_outputs(runner.fn_factory, runner.outputs)(device)


@dataclass(frozen=True, slots=True)
class ModelRunner:
    """A batched model's declared tensors and its per-replica factory: ``fn_factory(device)``
    loads the model on ``device`` and returns the batched callable serve runs, which takes
    ``{input name: array}`` and returns the outputs (not yet checked against ``outputs``:
    see :func:`~carpool.server.outputs.checking_outputs`)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    fn_factory: Callable[[str], Any]


def build_runner(
    model: ModelConfig, *, key: str | None = None, file: str | None = None
) -> ModelRunner:
    """The runner of a ``python``, ``torch`` or ``onnx`` model, as :func:`build_model`
    builds it, without a batcher (``carpool doctor`` calls it directly).

    Raises:
        ConfigError: as :func:`build_model`; on field ``kind`` for another kind.
    """
    if model.kind not in BATCHED_KINDS:
        raise ConfigError("kind", model.kind, f"one of {list(BATCHED_KINDS)}")
    base_dir = Path(file).resolve().parent if file is not None else Path.cwd()
    inputs, outputs = _specs(model, base_dir)
    fn_factory = _fn_factory(model, inputs, outputs)
    if key is not None:
        fn_factory = _naming_key(fn_factory, key, file)
    return ModelRunner(inputs, outputs, fn_factory)


def generation_settings(model: ModelConfig) -> GenerationSettings:
    """A generation model's settings: the keys given, GenerationSettings' defaults else."""
    given = {key: getattr(model, key) for key in GENERATION_FIELDS}
    given = {key: value for key, value in given.items() if value is not None}
    return GenerationSettings(
        **given, dtype=model.dtype or "float32", device=model.replica_devices()[0]
    )


def _collator(inputs: tuple[TensorSpec, ...]) -> str | RaggedDictCollator:
    ragged = [t.name for t in inputs if t.ragged]
    return RaggedDictCollator(ragged) if ragged else "dict"


def _tensors(tensors: list[TensorConfig]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape), t.ragged) for t in tensors)


def _outputs(tensors: list[TensorConfig], base_dir: Path) -> tuple[TensorSpec, ...]:
    """The declared outputs, each with the labels of its ``label_filename``, if any."""
    specs = []
    for j, (spec, tensor) in enumerate(zip(_tensors(tensors), tensors, strict=True)):
        name = tensor.label_filename
        if name is not None:
            labels = _labels(f"outputs[{j}].label_filename", name, base_dir / name, spec)
            spec = replace(spec, label_filename=name, labels=labels)
        specs.append(spec)
    return tuple(specs)


def _labels(key: str, name: str, path: Path, spec: TensorSpec) -> tuple[str, ...]:
    """The labels in ``path``: at least one per class when the output's shape is fixed.

    Raises:
        ConfigError: naming ``key``: the file cannot be read, is not UTF-8 or is short.
    """
    expected = "a UTF-8 text file of class labels, one per line, relative to the config file"
    try:
        labels = read_labels(path)
    except OSError as error:
        raise ConfigError(key, name, f"{expected}; {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(key, name, f"{expected}; {path} is not UTF-8") from None
    num_classes = math.prod(spec.shape)  # every element of a row is a class
    if -1 not in spec.shape and len(labels) < num_classes:
        raise ConfigError(
            key,
            name,
            f"{expected}: at least {num_classes}, one per class of output {spec.name!r} "
            f"(shape {list(spec.shape)}); {path} has {len(labels)} line(s)",
        )
    return labels


def _specs(
    model: ModelConfig, base_dir: Path
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    if model.kind != "onnx":
        if model.inputs is None or model.outputs is None:  # a hand-built config may lack them
            missing = "inputs" if model.inputs is None else "outputs"
            raise ConfigError(missing, None, f"the {missing} of a {model.kind} model")
        return _tensors(model.inputs), _outputs(model.outputs, base_dir)
    from carpool.models.onnx import read_tensors

    # Read even when both are declared: a bad file then fails here, before serving starts.
    file_inputs, file_outputs = read_tensors(model.source)
    inputs = (
        _tensors(model.inputs)
        if model.inputs is not None
        else tuple(_spec(t.spec(model.source)) for t in file_inputs)
    )
    outputs = (
        _outputs(model.outputs, base_dir)
        if model.outputs is not None
        else tuple(_spec(t.spec(model.source, is_output=True)) for t in file_outputs)
    )
    # Declared tensors must be the file's: a mismatch would pass every request's checks
    # and then fail each one inside onnxruntime with a 500.
    _check_against_file("inputs", inputs, file_inputs, every_file_tensor=True)
    _check_against_file("outputs", outputs, file_outputs, every_file_tensor=False)
    return inputs, outputs


def _spec(info: TensorInfo) -> TensorSpec:
    return TensorSpec(info.name, info.datatype, info.shape)


def _check_against_file(
    key: str,
    declared: tuple[TensorSpec, ...],
    in_file: list[FileTensor],
    *,
    every_file_tensor: bool,
) -> None:
    """``declared`` against the ONNX file's tensors ``in_file`` (``FileTensor``s): names,
    datatypes, a dynamic batch dim, ranks and dims, as Triton's onnxruntime backend checks
    them: a fixed dim in the file must be declared as that size (-1 would let requests of
    any size through to fail inside onnxruntime); a dim the file leaves dynamic may be
    declared fixed. A tensor the file gives no shape for is taken as declared. With
    ``every_file_tensor`` each of the file's tensors must be declared too (onnxruntime
    needs every input fed).

    Raises:
        ConfigError: naming ``key[j]`` and what the file has.
    """
    by_name = {t.name: t for t in in_file}
    for j, spec in enumerate(declared):
        found = by_name.get(spec.name)
        if found is None:
            raise ConfigError(f"{key}[{j}].name", spec.name, f"one of the file's {sorted(by_name)}")
        if found.datatype != spec.datatype:
            what = (
                f"{found.datatype} for {spec.name!r}, as in the file"
                if found.datatype is not None
                else f"a tensor onnxruntime returns as a NumPy array; {spec.name!r} in the file "
                f"is {found.type}"
            )
            raise ConfigError(f"{key}[{j}].datatype", spec.datatype, what)
        if not found.shape:  # the file does not say
            continue
        if found.shape[0] != -1:
            raise ConfigError(
                f"{key}[{j}]",
                spec.name,
                f"a dynamic first (batch) dimension in the file; it has {list(found.shape)}",
            )
        shape, file_shape = tuple(spec.shape), found.shape[1:]
        if len(shape) != len(file_shape) or any(
            a != b and b != -1 for a, b in zip(shape, file_shape, strict=False)
        ):
            raise ConfigError(
                f"{key}[{j}].shape",
                list(shape),
                f"{list(file_shape)} for {spec.name!r}, as in the file (after the batch dim; "
                "-1 only where the file's dim is dynamic)",
            )
    if every_file_tensor:
        missing = sorted(set(by_name) - {spec.name for spec in declared})
        if missing:
            raise ConfigError(key, [spec.name for spec in declared], f"also the file's {missing}")


def _naming_key(factory: Callable[[str], Any], key: str, file: str | None) -> Callable[[str], Any]:
    def make(device: str) -> Any:
        try:
            return factory(device)
        except ConfigError as error:
            if error.file is not None:
                raise
            raise keyed_error(error, key, file) from error

    return make


def _memory_probe(model: ModelConfig) -> MemoryProbe | None:
    """GPU memory for a torch model with replicas on CUDA; None for anything else."""
    if model.kind != "torch":
        return None
    from carpool.models.torch import cuda_memory_probe

    return cuda_memory_probe(model.replica_devices())


def _fn_factory(
    model: ModelConfig, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
) -> Callable[[str], Any]:
    input_names = [t.name for t in inputs]
    output_names = [t.name for t in outputs]
    if model.kind == "python":
        from carpool.models.python import load_python

        return load_python(model.source)
    if model.kind == "torch":
        from carpool.models.torch import torch_factory
        from carpool.models.torch_cuda import graph_sizes

        return torch_factory(
            model.source,
            input_names=input_names,
            output_names=output_names,
            dtype=model.dtype,
            ragged_inputs=[t.name for t in inputs if t.ragged],
            autocast=model.autocast,
            cuda_graphs=graph_sizes(model.preferred_batch_sizes, model.policy().size_limit)
            if model.cuda_graphs
            else None,
            output_dtypes=[
                None if t.datatype in ("BYTES", "BF16") else DATATYPES[t.datatype] for t in outputs
            ],
        )
    from carpool.models.onnx import onnx_factory

    return onnx_factory(model.source, input_names=input_names, output_names=output_names)
