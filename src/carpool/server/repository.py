"""The models a server serves: their declared tensors, batchers and KServe metadata.

A served model's function takes ``{input name: array}`` with the batch along axis 0 and
returns ``{output name: array}`` aligned with it. Declared shapes leave out the batch
dimension (as Triton's ``dims`` do); metadata shows it as ``-1``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from carpool.core.batcher import Batcher
from carpool.core.policy import BatchPolicy
from carpool.errors import ConfigError, InvalidInput, ModelError
from carpool.server.errors import NotFound
from carpool.server.tensors import DATATYPES, InferRequest

if TYPE_CHECKING:
    from carpool.server.embeddings import EmbeddingService

TIMEOUT_PARAMETER_UNIT_S = 1e-6  # Triton's "timeout" request parameter is in microseconds


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A declared tensor: ``shape`` without the batch dimension, ``-1`` for any length.

    An output may have ``labels``, one per class, read from ``label_filename`` (as given in
    the config) for Triton's classification extension (server/classification.py).
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    ragged: bool = False  # requests may differ in the first dimension; the model gets a Packed
    label_filename: str | None = None
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise ConfigError(
                f"tensor {self.name!r}.datatype", self.datatype, f"one of {list(DATATYPES)}"
            )
        if any(not isinstance(d, int) or d < -1 for d in self.shape):
            raise ConfigError(f"tensor {self.name!r}.shape", self.shape, "integers >= -1")

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape]}

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether a request tensor of ``shape`` (batch dimension first) fits this spec."""
        rest = shape[1:]
        if rest == self.shape:  # the common case, checked without a loop
            return len(shape) > 0
        return len(rest) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, rest, strict=True)
        )


@dataclass(frozen=True, slots=True)
class EngineScheduling:
    """How a model whose own engine schedules its requests (generation) runs them, in
    place of a batch policy: ``settings`` by their config keys, ``max_num_seqs`` and
    ``device`` among them."""

    settings: dict[str, int | str]

    def no_batch_policy(self, model: str) -> ConfigError:
        """What ``GET`` and ``POST .../policy`` answer for such a model (a 400)."""
        named = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return ConfigError(
            "policy",
            model,
            f"a batched model: a generation model has no batch policy; its engine schedules "
            f"by its engine settings ({named}), set in its config entry",
        )


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model behind one batcher.

    ``infer``, when given, answers KServe requests instead of submitting the payload to
    the batcher as one request (an embeddings model tokenizes first). ``embeddings`` is
    set for models that also answer OpenAI's ``/v1/embeddings``. ``engine`` is set for a
    model whose engine schedules its requests (generation): its batcher slot only starts
    and stops the engine, and holds no batch policy.
    """

    name: str
    version: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batcher: Batcher
    infer: Callable[[dict[str, np.ndarray], dict[str, Any]], Awaitable[Any]] | None = None
    embeddings: EmbeddingService | None = None
    engine: EngineScheduling | None = None

    async def run(
        self,
        payload: dict[str, np.ndarray],
        options: dict[str, Any],
        arrival_s: float | None = None,
    ) -> Any:
        """The outputs ``{name: array}`` for a checked payload (see :meth:`payload`);
        ``arrival_s``: when the request came (``time.monotonic``), which its deadline
        counts from."""
        if self.infer is not None:
            return await self.infer(payload, options)
        result = await self.batcher.submit_many(payload, **options, arrival_s=arrival_s)
        return self.outputs_of(result)

    def outputs_of(self, result: Any) -> dict[str, Any]:
        """The batcher's result for one request as ``{output name: array}``.

        Raises:
            ModelError: the model did not return a dict holding every declared output.
        """
        if not isinstance(result, dict):
            raise ModelError(
                f"model {self.name!r} returned a {type(result).__name__}; expected a dict of "
                f"its declared outputs {[spec.name for spec in self.outputs]}"
            )
        # Per-token outputs of ragged rows come back as lists.
        outputs = {k: np.stack(v) if isinstance(v, list) else v for k, v in result.items()}
        for spec in self.outputs:
            if spec.name not in outputs:
                raise ModelError(
                    f"model {self.name!r} returned outputs {sorted(outputs)}; the config "
                    f"declares {[s.name for s in self.outputs]}"
                )
        return outputs

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": self.platform,
            "inputs": [t.metadata() for t in self.inputs],
            "outputs": [t.metadata() for t in self.outputs],
        }

    def config(self) -> dict[str, Any]:
        """Triton-style model configuration (what ``get_model_config`` returns). A model
        its engine schedules (generation) has no ``dynamic_batching``: requests join and
        leave its batch at every step; ``max_batch_size`` is the most sequences a step
        runs (``max_num_seqs``), as Triton's TensorRT-LLM models declare it."""
        if self.engine is not None:
            settings = self.engine.settings
            return {
                "name": self.name,
                "platform": self.platform,
                "max_batch_size": settings["max_num_seqs"],
                "input": [_config_tensor(t) for t in self.inputs],
                "output": [_config_tensor(t) for t in self.outputs],
                "instance_group": _instance_groups((str(settings["device"]),)),
            }
        policy = self.batcher.policy
        return {
            "name": self.name,
            "platform": self.platform,
            "max_batch_size": policy.max_batch_size,
            "input": [_config_tensor(t) for t in self.inputs],
            "output": [_config_tensor(t) for t in self.outputs],
            "dynamic_batching": {
                "max_queue_delay_microseconds": min(round(policy.max_delay_s * 1e6), _UINT64_MAX),
                "preferred_batch_size": list(policy.preferred_batch_sizes),
                "priority_levels": len(policy.classes),
                "default_priority_level": 1
                + [c.name for c in policy.classes].index(policy.default_class),
                "default_queue_policy": _queue_policy(policy, policy.default_class),
                "priority_queue_policy": {
                    str(level): _queue_policy(policy, c.name)
                    for level, c in enumerate(policy.classes, start=1)
                },
            },
            "instance_group": _instance_groups(self.batcher.devices),
        }

    def payload(self, request: InferRequest) -> dict[str, np.ndarray]:
        """The request's inputs as the model's payload, checked against the declared specs.

        Raises:
            InvalidInput: naming the missing, unknown or mismatched input.
        """
        given = {t.name: t for t in request.inputs}
        declared = {t.name for t in self.inputs}
        unknown = sorted(set(given) - declared)
        if unknown:
            raise InvalidInput(
                f"unknown input {unknown[0]!r} for model {self.name!r}; expected {sorted(declared)}"
            )
        payload: dict[str, np.ndarray] = {}
        rows: set[int] = set()
        for spec in self.inputs:
            tensor = given.get(spec.name)
            if tensor is None:
                raise InvalidInput(f"missing input {spec.name!r} for model {self.name!r}")
            if tensor.datatype != spec.datatype:
                raise InvalidInput(
                    f"input {spec.name!r}: datatype {tensor.datatype}, expected {spec.datatype}"
                )
            if not spec.accepts(tensor.shape):
                raise InvalidInput(
                    f"input {spec.name!r}: shape {list(tensor.shape)}, expected "
                    f"{[-1, *spec.shape]} (-1: any size; the first dimension is the batch)"
                )
            payload[spec.name] = tensor.array
            rows.add(tensor.shape[0])
        if len(rows) > 1:
            raise InvalidInput(f"inputs disagree on the batch dimension: {sorted(rows)}")
        if rows == {0}:
            raise InvalidInput("the batch dimension is 0: send at least one row")
        return payload

    def submit_options(self, request: InferRequest) -> dict[str, Any]:
        """``priority`` and ``timeout`` request parameters as batcher keywords, read as
        Triton reads them: priority 1 is the highest level, and 0 or a level beyond the
        model's levels is the default one (``InferenceRequest::SetPriority``); a timeout
        is in microseconds, 0 meaning none of its own (``tritonserver.h``), and shortens
        the class's deadline but never lengthens it (``allow_timeout_override``).

        Raises:
            InvalidInput: a negative or non-integer priority or timeout, or a
                request that is part of a sequence (see :func:`_check_no_sequence`).
        """
        _check_no_sequence(request.parameters)
        options: dict[str, Any] = {}
        priority = request.parameters.get("priority")
        if isinstance(priority, str):
            options["priority"] = priority
        elif isinstance(priority, int) and not isinstance(priority, bool) and priority >= 0:
            classes = self.batcher.policy.classes
            if 1 <= priority <= len(classes):
                options["priority"] = classes[priority - 1].name
        elif priority is not None:
            names = [c.name for c in self.batcher.policy.classes]
            raise InvalidInput(
                f"parameter 'priority'={priority!r}: expected an integer >= 0 (1 highest) "
                f"or a class name {names}"
            )
        timeout = request.parameters.get("timeout")
        if timeout is not None:
            # An integer, as Triton reads it (REST: an unsigned integer; gRPC: int64_param
            # or uint64_param): 1.5 or a double_param is refused, not taken as 1.5 µs.
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
                raise InvalidInput(
                    f"parameter 'timeout'={timeout!r}: expected an integer number of "
                    "microseconds >= 0 (0: none of its own)"
                )
            if timeout:
                timeout_s = timeout * TIMEOUT_PARAMETER_UNIT_S
                class_timeout_s = self._class_timeout_s(options.get("priority"))
                if class_timeout_s is None or timeout_s < class_timeout_s:
                    options["timeout_s"] = timeout_s
        return options

    def _class_timeout_s(self, name: str | None) -> float | None:
        """The deadline of class ``name`` (None: the default class), which a request's
        own ``timeout`` may shorten and never lengthen, as Triton's
        ``allow_timeout_override``; None for no deadline or a class the batcher will
        refuse by name."""
        policy = self.batcher.policy
        if name is not None and name not in policy.limits:
            return None
        return policy.class_limits(name).timeout_s


def _check_no_sequence(parameters: dict[str, Any]) -> None:
    """Refuse a request of a sequence (Triton's sequence extension: ``sequence_id``,
    ``sequence_start``, ``sequence_end``). carpool's models are stateless and batch any
    requests together: answering as if the flags were absent would drop the state the
    client counts on. An id of 0 or "" with no flag set is no sequence, as the extension
    says, and passes."""
    sequence_id = parameters.get("sequence_id")
    is_start = parameters.get("sequence_start") not in (None, False)
    is_end = parameters.get("sequence_end") not in (None, False)
    if (
        sequence_id in (None, 0, "")
        and not isinstance(sequence_id, bool)
        and not (is_start or is_end)
    ):
        return
    given = {k: parameters[k] for k in SEQUENCE_PARAMETERS if k in parameters}
    raise InvalidInput(
        f"parameters {given}: sequences (stateful models, Triton's 'sequence' extension) "
        "are not supported: carpool's models are stateless; send the request without "
        "sequence_id, sequence_start and sequence_end"
    )


SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def _instance_groups(devices: tuple[str, ...]) -> list[dict[str, Any]]:
    """Triton's ``instance_group`` for replicas on ``devices``: one group per device, a
    ``cuda:N`` one as ``KIND_GPU`` on GPU N, the others as ``KIND_CPU``."""
    counts: dict[str, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    groups: list[dict[str, Any]] = []
    num_cpu = 0
    for device, count in counts.items():
        kind, _, index = device.partition(":")
        if kind == "cuda":
            groups.append(
                {"count": count, "kind": "KIND_GPU", "gpus": [int(index) if index.isdigit() else 0]}
            )
        else:
            num_cpu += count
    if num_cpu:
        groups.append({"count": num_cpu, "kind": "KIND_CPU"})
    return groups


_CONFIG_TYPES = {"BYTES": "STRING"}  # Triton's config names BYTES as TYPE_STRING


def _queue_policy(policy: BatchPolicy, name: str) -> dict[str, Any]:
    """Class ``name``'s queue as Triton's ``ModelQueuePolicy``: its deadline and the most
    of its requests that may wait (the smaller of its own bound and the model's, which
    all classes share; 0: none). Expired requests are rejected, never run late; a
    request's own ``timeout`` may shorten the default, never lengthen it."""
    timeout_s = policy.class_limits(name).timeout_s
    return {
        "timeout_action": "REJECT",
        "default_timeout_microseconds": 0 if timeout_s is None else _microseconds(timeout_s),
        "allow_timeout_override": True,
        # Triton's field is a uint32: a larger bound is shown as the largest it holds.
        "max_queue_size": min(policy.max_queued(name) or 0, _UINT32_MAX),
    }


_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def _microseconds(seconds: float) -> int:
    """A timeout as Triton's uint64 microseconds, where 0 means none: at least 1 (a
    timeout under half a microsecond is not none) and at most the largest uint64 (a
    config may give 1e20 s; gRPC's ModelConfig could not carry it and the call failed)."""
    return min(max(1, round(seconds * 1e6)), _UINT64_MAX)


def _config_tensor(spec: TensorSpec) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": spec.name,
        "data_type": f"TYPE_{_CONFIG_TYPES.get(spec.datatype, spec.datatype)}",
        "dims": list(spec.shape),
    }
    if spec.ragged:
        config["allow_ragged_batch"] = True
    if spec.label_filename is not None:
        config["label_filename"] = spec.label_filename
    return config


class ModelRepository:
    """Served models by name."""

    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {m.name: m for m in models}
        if len(self._models) != len(models):
            raise ConfigError("models[].name", [m.name for m in models], "unique model names")

    def __iter__(self) -> Any:
        return iter(self._models.values())

    def get(self, name: str, version: str | None = None) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"model {name!r}", sorted(self._models), is_model=True)
        if version not in (None, "", model.version):
            raise NotFound(f"version {version!r} of model {name!r}", [model.version], is_model=True)
        return model

    async def start(self) -> None:
        """Start every model, or none: when one fails, those started are stopped again
        (their replica threads, and the GIL switch interval they hold, released)."""
        started = []
        try:
            for model in self._models.values():
                await model.batcher.start()
                started.append(model)
        except BaseException:
            for model in started:
                await model.batcher.stop(drain=False)
            raise

    async def stop(self) -> None:
        for model in self._models.values():
            await model.batcher.stop(drain=True)

    def cut_off(self) -> int:
        """Cut every model's drain off (:meth:`Batcher.cut_off`): what is still queued or
        running fails with Closed. Returns how many requests were cut off."""
        return sum(model.batcher.cut_off() for model in self._models.values())

    @property
    def is_ready(self) -> bool:
        """Every model is ready (:attr:`Batcher.is_ready`): running, with a replica that
        is not being replaced after a hang."""
        return all(m.batcher.is_ready for m in self._models.values())

    def index(self, *, is_ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every model (only the ready ones when
        ``is_ready_only``) with its version and state, ``READY`` or ``UNAVAILABLE``."""
        entries = []
        for model in self._models.values():
            is_model_ready = model.batcher.is_ready
            if is_model_ready or not is_ready_only:
                state = "READY" if is_model_ready else "UNAVAILABLE"
                entries.append(
                    {"name": model.name, "version": model.version, "state": state, "reason": ""}
                )
        return entries
