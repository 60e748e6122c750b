"""Typed configuration of ``carpool serve CONFIG.yaml``, read from YAML.

::

    models:
      - name: mlp2
        kind: python              # python | torch | onnx | embeddings | generation
        source: mypkg.mod:attr    # module:attr; torch also takes a .pt/.pt2 file, onnx a .onnx
                                  # file, embeddings and generation a Hugging Face model folder
        inputs:  [{name: INPUT0, datatype: FP32, shape: [256]}]   # no batch dim; -1: any size
        outputs: [{name: OUTPUT0, datatype: FP32, shape: [16]}]
        max_batch_size: 64        # every BatchPolicy field by its name
        max_delay_s: 0.002
      - name: llama
        kind: generation          # continuous batching over a paged KV cache (docs/generation.md)
        source: ./tinyllama       # config.json (llama | gpt2), model.safetensors, tokenizer.json
        max_num_seqs: 64          # GENERATION_FIELDS: block_size, num_blocks or
        max_model_len: 2048       # kv_cache_memory_mb, max_num_batched_tokens, ...

File paths in ``source`` and an output's ``label_filename`` (its class labels, one per
line, for Triton's classification extension) are relative to the config file's folder.
Every error is a :class:`~carpool.errors.ConfigError` naming the file, the key path
(``models[0].max_delay_s``) and what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from carpool.config_yaml import load_yaml
from carpool.core.buffer_pool import DEFAULT_BUFFER_POOL_MB
from carpool.core.policy import BatchPolicy, ClassPolicy
from carpool.errors import ConfigError
from carpool.models._source import is_import_ref

Kind = Literal["python", "torch", "onnx", "embeddings", "generation"]
# KServe v2 datatypes (carpool.server.kserve.tensors.DATATYPES holds their NumPy dtypes; a test
# keeps the two lists equal without making the config import the server).
Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
]
QueueTime = Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["auto"] | None
TorchDtype = Literal["float32", "float16", "bfloat16", "float64"]

_POLICY_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(BatchPolicy) if f.init
}
_CLASS_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(ClassPolicy) if f.init
}
POLICY_FIELDS = (
    "max_batch_size",
    "max_delay_s",
    "preferred_batch_sizes",
    "max_batch_cost",
    "max_queue_size",
    "max_queue_time_s",
    "timeout_s",
    "default_class",
    "fill_from_lower",
    "oom_recovery_s",
    "max_batch_tokens",
    "length_buckets",
    "batch_timeout_s",
    "slo_s",
    "preempt",
)
# Keys only a generation model takes (carpool.generation.build.GenerationSettings).
GENERATION_FIELDS = (
    "block_size",
    "num_blocks",
    "kv_cache_memory_mb",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "decode_attention",
)


_MAX_INPUTS_DEFAULT = 2048  # texts in one embeddings request (OpenAI's own limit)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()

# A model's name and version appear in URL paths (/v2/models/{name}/versions/{version}).
URL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
_URL_NAME_EXPECTED = (
    "a name that can appear in a URL path: letters, digits, '_', '.' and '-', "
    "starting with a letter or digit"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TensorConfig(_Strict):
    """One declared tensor; ``shape`` leaves out the batch dimension, ``-1`` is any size."""

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: list[int]
    # Requests may differ in this input's first dimension; the model gets it packed.
    ragged: bool = False
    # An output's class labels, one per line, for Triton's classification extension
    # (server/classification.py); relative to the config file's folder.
    label_filename: str | None = Field(None, min_length=1)

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        # As Triton: a dimension of 0 would admit only empty tensors.
        if any(d < 1 and d != -1 for d in shape):
            raise ValueError("dimensions >= 1, or -1 for any size")
        return shape


class ClassConfig(_Strict):
    """One priority class; the fields of :class:`~carpool.core.policy.ClassPolicy`."""

    name: str = Field(min_length=1)
    max_batch_size: int | None = Field(None, ge=1)
    # seconds, or "auto": chosen from the traffic within slo_s (carpool.core.adaptive)
    max_delay_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["auto"] | None = None
    max_queue_size: int | None = Field(None, ge=1)
    # a queue bound in time: seconds, or "auto" (within slo_s; carpool.core.queue_time)
    max_queue_time_s: QueueTime = None
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    share: float = Field(_CLASS_DEFAULTS["share"], gt=0, le=1)
    max_wait_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    slo_s: float | None = Field(None, gt=0, allow_inf_nan=False)

    def policy(self) -> ClassPolicy:
        return ClassPolicy(**self.model_dump())


class RayPlacementConfig(_Strict):
    """``ray_placement``: the model's replicas reserved together in a Ray placement group."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class ModelConfig(_Strict):
    """One served model: where it comes from, its tensors, how it is batched and placed."""

    name: str = Field(pattern=URL_NAME)
    kind: Kind
    source: str = Field(min_length=1)
    version: str = Field("1", pattern=URL_NAME)
    inputs: list[TensorConfig] | None = Field(None, min_length=1)
    outputs: list[TensorConfig] | None = Field(None, min_length=1)
    # BatchPolicy, field by field; defaults are BatchPolicy's.
    # "auto" for either: chosen from the traffic (carpool.core.adaptive), within slo_s.
    max_batch_size: int | Literal["auto"] = _POLICY_DEFAULTS["max_batch_size"]
    max_delay_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["auto"] = (
        _POLICY_DEFAULTS["max_delay_s"]
    )
    # The model's latency target, inherited by classes that set none.
    slo_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    max_batch_cost: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_queue_size: int | None = Field(None, ge=1)
    # a queue bound in time: seconds, or "auto" (within slo_s; carpool.core.queue_time)
    max_queue_time_s: QueueTime = None
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    classes: list[ClassConfig] | None = Field(None, min_length=1)
    default_class: str = _POLICY_DEFAULTS["default_class"]
    fill_from_lower: bool = _POLICY_DEFAULTS["fill_from_lower"]
    # A higher class's batch runs between the steps of a lower-class batch (models in
    # steps on the event loop; carpool.core.stepwise).
    preempt: bool = _POLICY_DEFAULTS["preempt"]
    oom_recovery_s: float = Field(_POLICY_DEFAULTS["oom_recovery_s"], ge=0, allow_inf_nan=False)
    max_batch_tokens: int | None = Field(None, ge=1)
    length_buckets: list[int] | Literal["auto"] | None = None
    # Longest one batch may run before its requests fail and its replica is replaced;
    # null: no limit.
    batch_timeout_s: float | None = Field(
        _POLICY_DEFAULTS["batch_timeout_s"], gt=0, allow_inf_nan=False
    )
    # embeddings: most texts in one request
    max_inputs: int = Field(_MAX_INPUTS_DEFAULT, ge=1)
    # generation: KV-cache layout and step limits (GENERATION_FIELDS)
    block_size: int | None = Field(None, ge=1, le=1024)
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_mb: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    # Attention over the paged cache: the C++ decode and prefill kernels (kernel), gather +
    # SDPA (torch), or the kernels where they build (auto, the default).
    # carpool.generation.paged_decode
    decode_attention: Literal["auto", "kernel", "torch"] | None = None
    # Placement.
    num_replicas: int | None = Field(None, ge=1)
    devices: list[str] | None = Field(None, min_length=1)
    device: str | None = None  # every replica's device when devices is not given (cpu)
    dtype: TorchDtype | None = None
    # embeddings: int8 Linear layers (per-channel weights, per-token activations; CPU, float32)
    quantization: Literal["int8"] | None = None
    # Where a sync model runs (Batcher's executor); None: the kind's default.
    executor: Literal["auto", "thread", "loop", "process", "ray"] | None = None
    # executor: process: the CPUs each replica's process is pinned to, as [[0], [1]].
    replica_cpus: list[list[int]] | None = None
    # Collate into buffers reused batch after batch, at most buffer_pool_mb MiB of them idle.
    buffer_pool: bool = True
    buffer_pool_mb: float = Field(DEFAULT_BUFFER_POOL_MB, gt=0, allow_inf_nan=False)
    # torch: CUDA graphs captured at the preferred batch sizes; float32 weights under autocast.
    cuda_graphs: bool = False
    autocast: bool = False
    # executor: ray: the Ray resources each replica's actor takes, as {num_cpus: 1}, and
    # how often Ray restarts a dead actor before carpool creates another (-1: no limit).
    ray_resources: dict[str, float] | None = None
    max_restarts: int | None = Field(None, ge=-1)
    # executor: ray: one bundle of ray_resources per replica, reserved together.
    ray_placement: RayPlacementConfig | None = None

    @field_validator("version", mode="before")
    @classmethod
    def _version_from_int(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("max_batch_size")
    @classmethod
    def _max_batch_size(cls, size: int | str) -> int | str:
        if isinstance(size, str):
            return size
        # Triton's max_batch_size: 0 (a model with no batch dimension) is the likely
        # reason for a 0 here: say what carpool does instead.
        if size < 1:
            raise ValueError(
                "at least 1: every model takes a first (batch) dimension that `shape` leaves "
                "out; for Triton's 0 (no batching) give 1, and clients send that dimension as 1"
            )
        return size

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _sizes(cls, sizes: list[int]) -> list[int]:
        if any(s < 1 for s in sizes):
            raise ValueError("batch sizes >= 1")
        return sizes

    def policy(self) -> BatchPolicy:
        """The batch policy these fields describe.

        Raises:
            ConfigError: when the fields contradict each other (named as BatchPolicy names them).
        """
        fields: dict[str, Any] = {name: getattr(self, name) for name in POLICY_FIELDS}
        fields["preferred_batch_sizes"] = tuple(self.preferred_batch_sizes)
        if isinstance(self.length_buckets, list):
            fields["length_buckets"] = tuple(self.length_buckets)
        if self.classes is not None:
            fields["classes"] = tuple(c.policy() for c in self.classes)
        return BatchPolicy(**fields)

    def replica_devices(self) -> list[str]:
        """One device string per replica: ``devices``, else ``device`` ``num_replicas`` times."""
        if self.devices is not None:
            return list(self.devices)
        return [self.device or "cpu"] * (self.num_replicas or 1)


class RayConfig(_Strict):
    """The Ray cluster the ``executor: ray`` models run on (``ray.init``'s arguments)."""

    address: str | None = Field(None, min_length=1)  # "auto": the one on this machine
    namespace: str | None = Field(None, min_length=1)
    runtime_env: dict[str, Any] | None = None


class ServeConfig(_Strict):
    """What ``carpool serve CONFIG.yaml`` serves."""

    models: list[ModelConfig] = Field(min_length=1)
    ray: RayConfig | None = None


_NESTED: dict[tuple[type[BaseModel], str], type[BaseModel]] = {
    (ServeConfig, "models"): ModelConfig,
    (ModelConfig, "inputs"): TensorConfig,
    (ModelConfig, "outputs"): TensorConfig,
    (ModelConfig, "classes"): ClassConfig,
    (ModelConfig, "ray_placement"): RayPlacementConfig,
    (ServeConfig, "ray"): RayConfig,
}


def load_config(path: str | Path) -> ServeConfig:
    """Read and validate a serve configuration file.

    File paths in ``source`` are resolved against the file's folder (and stored absolute).

    Raises:
        ConfigError: naming the file, the key path and what was expected.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError("file", file, f"a readable file ({error.strerror})", file=file) from None
    except UnicodeDecodeError:
        raise ConfigError("file", file, "a YAML text file in UTF-8", file=file) from None
    data = load_yaml(text, file)
    if data is None:
        expected = "a mapping with a models list; the file is empty (or only comments)"
        raise ConfigError("(top level)", MISSING, expected, file=file)
    return parse_config(data, file=file, base_dir=Path(path).resolve().parent)


def parse_config(data: Any, *, file: str = "<config>", base_dir: Path | None = None) -> ServeConfig:
    """Validate already-parsed YAML/JSON ``data`` (see :func:`load_config`)."""
    try:
        config = ServeConfig.model_validate(data)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        first, key = errors[0], _key_loc(tuple(errors[0]["loc"]))
        union = []  # the other members of a union (list[int] | 'auto') that failed on key
        if key != tuple(first["loc"]) and first["type"] != "extra_forbidden":
            union = [e for e in errors[1:] if _key_loc(tuple(e["loc"])) == key]
            first = {**first, "loc": key}
        # A key whose every union member failed is one problem, not one per member.
        num_more = len({_key_loc(tuple(e["loc"])) for e in errors}) - 1
        raise _pydantic_error(first, file, num_more=num_more, union=union) from None
    problems = list(_semantic_problems(config, base_dir or Path.cwd()))
    if problems:
        key, value, expected = problems[0]
        if len(problems) > 1:
            expected += f" (and {len(problems) - 1} more problem(s))"
        raise ConfigError(key, value, expected, file=file)
    if base_dir is not None:
        config = _with_absolute_sources(config, base_dir)
    return config


def key_path(loc: tuple[int | str, ...]) -> str:
    """``("models", 0, "max_delay_s")`` as ``models[0].max_delay_s``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _pydantic_error(
    error: ErrorDetails, file: str, *, num_more: int, union: list[ErrorDetails] | None = None
) -> ConfigError:
    loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        expected = "a known key" + _did_you_mean(str(loc[-1]), _known_keys(loc[:-1]))
        value: object = error["input"]
    elif kind == "missing":
        expected, value = "a value (the key is required)", MISSING
    else:
        expected = " or ".join(dict.fromkeys(_expected(e) for e in [error, *(union or [])]))
        value = error["input"]
    if num_more:
        expected += f" (and {num_more} more problem(s))"
    return ConfigError(key_path(loc), value, expected, file=file)


def _expected(error: ErrorDetails) -> str:
    """What pydantic's ``error`` says was expected, in the config's words (no class names,
    no regular expressions)."""
    kind, ctx = error["type"], error.get("ctx", {})
    if kind in ("model_type", "dict_type"):
        return "a mapping (key: value)"
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == URL_NAME:
        return _URL_NAME_EXPECTED
    if kind == "string_too_short":
        return "a non-empty string"
    if kind == "too_short":
        return f"a list of at least {ctx.get('min_length', 1)} item(s)"
    message = error["msg"].removeprefix("Value error, ")
    return message.removeprefix("Input should be ").removeprefix("input should be ")


def _key_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` up to the first part that is no key: pydantic's tag of a union member
    (``("models", 0, "length_buckets", "list[int]")``)."""
    out: list[int | str] = []
    model: type[BaseModel] | None = ServeConfig
    for part in loc:
        if isinstance(part, str):
            if model is None or part not in model.model_fields:
                break
            model = _NESTED.get((model, part))
        out.append(part)
    return tuple(out)


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = ServeConfig
    for part in loc:
        if isinstance(part, str):
            model = _NESTED[model, part]
    return list(model.model_fields)


def _did_you_mean(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known keys: {', '.join(known)}" if known else ""


def _semantic_problems(config: ServeConfig, base_dir: Path) -> Any:
    """(key path, value, expected) for what field types alone cannot check."""
    first_index: dict[str, int] = {}
    for i, model in enumerate(config.models):
        at = f"models[{i}]"
        if model.name in first_index:
            yield (
                f"{at}.name",
                model.name,
                f"a name no other model has (models[{first_index[model.name]}] has it)",
            )
        first_index.setdefault(model.name, i)
        yield from _source_problems(model, at, base_dir)
        for key in ("inputs", "outputs"):
            tensors = getattr(model, key)
            if tensors is not None and model.kind in ("embeddings", "generation"):
                yield (f"{at}.{key}", "[...]", f"nothing: a {model.kind} model declares its own")
            if tensors is None and model.kind not in ("onnx", "embeddings", "generation"):
                yield (
                    f"{at}.{key}",
                    MISSING,
                    f"a list of {{name, datatype, shape}}: a {model.kind} model cannot tell its "
                    f"{key} (only onnx reads them from the model file)",
                )
            if key == "inputs" and model.kind == "onnx" and any(t.ragged for t in tensors or []):
                yield (f"{at}.inputs", "ragged: true", "no ragged inputs for onnx models")
            for j, tensor in enumerate(tensors or []):
                if key == "inputs" and tensor.label_filename is not None:
                    where = f"{at}.inputs[{j}].label_filename"
                    yield (where, tensor.label_filename, "nothing: only outputs take class labels")
                if tensor.ragged and key == "outputs":
                    where = f"{at}.outputs[{j}].ragged"
                    yield (where, True, "nothing: only inputs are ragged (Triton's too)")
                elif tensor.ragged and not tensor.shape:
                    where = f"{at}.inputs[{j}].ragged"
                    yield (
                        where,
                        True,
                        "an input whose shape has a first dimension, its length ([-1])",
                    )
            names = [t.name for t in tensors or []]
            for j, name in enumerate(names):
                if name in names[:j]:
                    yield (f"{at}.{key}[{j}].name", name, f"a name unique among the {key}")
        if model.devices is not None:
            if model.num_replicas is not None and model.num_replicas != len(model.devices):
                yield (
                    f"{at}.num_replicas",
                    model.num_replicas,
                    f"{len(model.devices)}, one replica per entry of devices (or leave it out)",
                )
            if model.device is not None:
                yield (f"{at}.device", model.device, "no device when devices is given")
        if model.dtype is not None and model.kind not in ("torch", "embeddings", "generation"):
            yield (
                f"{at}.dtype",
                model.dtype,
                "no dtype: only torch, embeddings and generation models take one",
            )
        if model.quantization is not None and model.kind != "embeddings":
            yield (
                f"{at}.quantization",
                model.quantization,
                "no quantization: only embeddings models take one",
            )
        # (its default, as a dump of the config writes it, sets nothing to refuse)
        if model.max_inputs != _MAX_INPUTS_DEFAULT and model.kind != "embeddings":
            yield (
                f"{at}.max_inputs",
                model.max_inputs,
                "no max_inputs: only embeddings models take one (texts per request)",
            )
        if model.executor in ("process", "ray") and model.kind not in ("python", "torch", "onnx"):
            yield (f"{at}.executor", model.executor, "thread, loop or auto for this kind of model")
        for key in ("ray_resources", "max_restarts", "ray_placement"):
            if getattr(model, key) is not None and model.executor != "ray":
                yield (f"{at}.{key}", getattr(model, key), "nothing unless executor: ray")
        for name, amount in (model.ray_resources or {}).items():
            if not name or not math.isfinite(amount) or amount < 0:
                yield (f"{at}.ray_resources.{name}", amount, "a resource name and a number >= 0")
        if model.replica_cpus is not None and model.executor != "process":
            yield (f"{at}.replica_cpus", model.replica_cpus, "nothing unless executor: process")
        # On by default for every batched kind; a generation model refuses only one that
        # asks for it, since it keeps its own KV cache.
        if (
            model.kind == "generation"
            and model.buffer_pool
            and "buffer_pool" in model.model_fields_set
        ):
            yield (f"{at}.buffer_pool", True, "false: a generation model keeps its own KV cache")
        for key in ("cuda_graphs", "autocast"):
            if getattr(model, key) and model.kind != "torch":
                yield (f"{at}.{key}", True, "false: only torch models take it")
        if model.kind == "generation" and len(model.replica_devices()) > 1:
            yield (f"{at}.devices", model.replica_devices(), "one device: one engine per model")
        for key in GENERATION_FIELDS:
            if model.kind != "generation" and getattr(model, key) is not None:
                yield (f"{at}.{key}", getattr(model, key), "nothing: a generation model's key")
        try:
            model.policy()
        except ConfigError as error:
            yield (f"{at}.{error.field}", error.value, error.expected)


def _source_problems(model: ModelConfig, at: str, base_dir: Path) -> Any:
    source = model.source
    if not _is_file_source(model):
        if not is_import_ref(source):
            yield (f"{at}.source", source, "module:attr (an importable module and a name in it)")
            return
        # A file named as if it were a module would fail to import as "No module named ...":
        # say what the file is instead.
        module, _, attr = source.partition(":")
        if (base_dir / module).is_file():
            if module.endswith(".py"):
                yield (
                    f"{at}.source",
                    source,
                    f"module:attr, the module's name: {module[:-3]}:{attr}",
                )
            elif model.kind == "torch":
                yield (
                    f"{at}.source",
                    source,
                    f"the model file's path alone, {module} (a TorchScript or .pt2 file takes "
                    "no ':attr'), or module:factory",
                )
        return
    path = base_dir / source
    if model.kind in ("embeddings", "generation"):
        if not (path / "config.json").is_file():
            yield (
                f"{at}.source",
                source,
                f"a Hugging Face model folder; {path}/config.json is missing",
            )
        return
    if not path.is_file():
        what = "a .onnx" if model.kind == "onnx" else "module:factory or a TorchScript/.pt2"
        why = "is not a file" if path.exists() else "does not exist"
        yield (f"{at}.source", source, f"{what} file; {path} {why}")


def _is_file_source(model: ModelConfig) -> bool:
    return model.kind in ("onnx", "embeddings", "generation") or (
        model.kind == "torch" and not is_import_ref(model.source)
    )


def _with_absolute_sources(config: ServeConfig, base_dir: Path) -> ServeConfig:
    models = [
        m.model_copy(update={"source": str((base_dir / m.source).resolve())})
        if _is_file_source(m)
        else m
        for m in config.models
    ]
    return config.model_copy(update={"models": models})
