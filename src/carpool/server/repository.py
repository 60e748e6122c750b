"""The models a server serves: their declared tensors, what runs them, KServe metadata.

A served model's function takes ``{input name: array}`` with the batch along axis 0 and
returns ``{output name: array}`` aligned with it. Declared shapes leave out the batch
dimension (as Triton's ``dims`` do); metadata shows it as ``-1``.

What a model answers is explicit in its :class:`ServedModel`::

    every model         KServe v2 infer (HTTP, gRPC): ``infer`` or, without it, the batcher
    batcher             a core batcher batches its requests (KServe models, embeddings);
                        it has a batch policy (``/policy``, ``dynamic_batching``)
    embeddings          also OpenAI ``/v1/embeddings`` (its texts go to that batcher)
    generation          OpenAI ``/v1/completions``, ``/v1/chat/completions``: no batcher,
                        its engine schedules every step by its engine settings

The services (``server/embeddings.py``, ``server/generation.py``) know nothing of this
module: :meth:`ServedModel.of_embeddings` and :meth:`ServedModel.of_generation` serve them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from carpool.core.batcher import Batcher
from carpool.core.collate import shared_rows
from carpool.core.front import BatchFront
from carpool.core.policy import MAX_AUTO_DELAY_S, BatchPolicy
from carpool.errors import ConfigError, InvalidInput
from carpool.server.errors import NotFound
from carpool.server.kserve.tensors import DATATYPES, InferRequest

if TYPE_CHECKING:
    from carpool.server.embeddings import EmbeddingService
    from carpool.server.generation import GenerationService

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


KServeInfer = Callable[[dict[str, np.ndarray], dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model, and what runs its requests: a core batcher or a generation engine.

    ``batcher`` batches a model's requests (a KServe model's, an embeddings model's
    texts); a generation model has none: its engine schedules its requests at every
    step, so it has no batch policy. ``infer``, when given, answers KServe requests
    instead of submitting the payload to the batcher as one request (an embeddings model
    tokenizes first, a generation model generates). ``embeddings`` and ``generation``
    are the services behind the OpenAI endpoints.

    Raises:
        ConfigError: a model with neither or both of ``batcher`` and ``generation``, or
            with no way to answer KServe (no batcher and no ``infer``).
    """

    name: str
    version: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batcher: BatchFront | None = None  # a Batcher, or a front-end worker's face of one
    infer: KServeInfer | None = None
    embeddings: EmbeddingService | None = None
    generation: GenerationService | None = None

    def __post_init__(self) -> None:
        if (self.batcher is None) == (self.generation is None):
            runs = "both" if self.batcher is not None else "neither"
            raise ConfigError(
                f"model {self.name!r}", runs, "a batcher or a generation engine to run it"
            )
        if self.batcher is None and self.infer is None:
            raise ConfigError(
                f"model {self.name!r}.infer", None, "its engine's KServe face (no batcher)"
            )

    @classmethod
    def of_embeddings(cls, service: EmbeddingService) -> ServedModel:
        """An embeddings model: KServe ``TEXT`` (BYTES, one UTF-8 text a row) in,
        ``EMBEDDING`` (FP32) out, and ``/v1/embeddings``; each text is one request to
        its batcher."""
        return cls(
            name=service.name,
            version="1",
            platform="pytorch",
            inputs=(TensorSpec("TEXT", "BYTES", ()),),
            outputs=(TensorSpec("EMBEDDING", "FP32", (service.dimensions,)),),
            batcher=service.batcher,
            infer=service.infer,
            embeddings=service,
        )

    @classmethod
    def of_generation(cls, service: GenerationService) -> ServedModel:
        """A generation model: KServe ``TEXT`` rows in, each row's continuation out as
        ``TEXT``, and ``/v1/completions`` and ``/v1/chat/completions``."""
        return cls(
            name=service.name,
            version="1",
            platform="pytorch",
            inputs=(TensorSpec("TEXT", "BYTES", ()),),
            outputs=(TensorSpec("TEXT", "BYTES", ()),),
            infer=service.infer,
            generation=service,
        )

    # -- what runs the requests: the batcher or the engine ------------------------------

    async def start(self) -> None:
        if self.generation is not None:
            await self.generation.engine.start()
        else:
            await self._batcher().start()

    async def stop(self, *, drain: bool = True) -> None:
        """Stop taking requests and answer every one accepted (``drain``), or fail them."""
        if self.generation is not None:
            await self.generation.engine.stop(drain=drain)
        else:
            await self._batcher().stop(drain=drain)

    def cut_off(self) -> int:
        """Cut the drain off (:meth:`Batcher.cut_off`, :meth:`GenerationEngine.cut_off`):
        what is still queued or running fails with Closed; how many requests that was."""
        if self.generation is not None:
            return self.generation.engine.cut_off()
        return self._batcher().cut_off()

    @property
    def is_ready(self) -> bool:
        """Running and able to take requests: the batcher has a replica that is not
        being replaced after a hang; the engine's step loop runs."""
        if self.generation is not None:
            return self.generation.engine.is_running
        return self._batcher().is_ready

    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet answered."""
        if self.generation is not None:
            return self.generation.engine.num_active
        return self._batcher().num_pending

    @property
    def policy(self) -> BatchPolicy | None:
        """The batcher's policy; None for a generation model (it has none)."""
        return None if self.batcher is None else self.batcher.policy

    @property
    def policy_version(self) -> int:
        """The batcher's :attr:`~carpool.core.batcher.Batcher.policy_version`; 0 for a
        generation model (its classes never change)."""
        return 0 if self.batcher is None else self.batcher.policy_version

    @property
    def class_names(self) -> tuple[str, ...]:
        """The priority classes a request may name, highest first."""
        if self.generation is not None:
            return self.generation.classes
        return tuple(c.name for c in self._batcher().policy.classes)

    def require_policy(self) -> BatchPolicy:
        """The batch policy, for ``/policy``: what a front-end worker can check too.

        Raises:
            ConfigError: for a generation model (a 400 on ``/policy``), as
                :meth:`require_batcher`.
        """
        if self.generation is not None:
            raise self.generation.no_batch_policy()
        return self._batcher().policy

    def require_batcher(self) -> Batcher:
        """The batcher, for what only a batched model has: the policy ``GET`` and
        ``POST .../policy`` show and set, what ``carpool tune`` and ``bench`` drive.

        Raises:
            ConfigError: for a generation model (a 400 on ``/policy``): its engine
                schedules by its engine settings, so a batch policy would be answered as
                set and change nothing.
        """
        if self.generation is not None:
            raise self.generation.no_batch_policy()
        batcher = self._batcher()
        assert isinstance(batcher, Batcher), "asked of the engine, never of a front-end worker"
        return batcher

    def _batcher(self) -> BatchFront:
        assert self.batcher is not None, "a model without a generation engine has a batcher"
        return self.batcher

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
        result = await self._batcher().submit_many(payload, **options, arrival_s=arrival_s)
        return self.outputs_of(result)

    def outputs_of(self, result: Any) -> dict[str, Any]:
        """The batcher's result for one request as ``{output name: array}``: per-token
        outputs of ragged rows come back as lists of rows, stacked here. The result was
        checked against the declared outputs once, per batch, before it was split
        (:func:`carpool.server.outputs.check_outputs`)."""
        return {k: np.stack(v) if isinstance(v, list) else v for k, v in result.items()}

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
        runs (``max_num_seqs``), as Triton's TensorRT-LLM models declare it; its
        ``parameters`` (Triton's string map) name the kernels that run: decode attention
        (``kernel`` or ``torch``), the Linear layers', the elementwise steps'
        (``elementwise``), and the pages the KV cache and packed weights are on
        (``huge_pages``)."""
        if self.generation is not None:
            settings = self.generation.engine_settings()
            kernels = self.generation.kernels()
            return {
                "name": self.name,
                "platform": self.platform,
                "max_batch_size": settings["max_num_seqs"],
                "input": [_config_tensor(t) for t in self.inputs],
                "output": [_config_tensor(t) for t in self.outputs],
                "instance_group": _instance_groups((str(settings["device"]),)),
                "parameters": {k: {"string_value": v} for k, v in kernels.items()},
            }
        batcher = self._batcher()
        policy = batcher.policy
        return {
            "name": self.name,
            "platform": self.platform,
            "max_batch_size": policy.size_limit,
            "input": [_config_tensor(t) for t in self.inputs],
            "output": [_config_tensor(t) for t in self.outputs],
            "dynamic_batching": {
                "max_queue_delay_microseconds": _delay_us(policy.max_delay_s),
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
            "instance_group": _instance_groups(batcher.devices),
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
        if payload and shared_rows(payload) == 0:
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
            classes = self.class_names
            if 1 <= priority <= len(classes):
                options["priority"] = classes[priority - 1]
        elif priority is not None:
            names = list(self.class_names)
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
        refuse by name (a generation model's classes have none)."""
        policy = self.policy
        if policy is None or (name is not None and name not in policy.limits):
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

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def embedding_services(self) -> dict[str, EmbeddingService]:
        """The models that answer ``/v1/embeddings``, by name."""
        return {m.name: m.embeddings for m in self._models.values() if m.embeddings is not None}

    def generation_services(self) -> dict[str, GenerationService]:
        """The models that answer ``/v1/completions`` and ``/v1/chat/completions``."""
        return {m.name: m.generation for m in self._models.values() if m.generation is not None}

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
                await model.start()
                started.append(model)
        except BaseException:
            for model in started:
                await model.stop(drain=False)
            raise

    async def stop(self) -> None:
        for model in self._models.values():
            await model.stop()

    def cut_off(self) -> int:
        """Cut every batcher's drain off (:meth:`Batcher.cut_off`): what is still queued
        or running fails with Closed. Returns how many requests were cut off."""
        return sum(model.cut_off() for model in self._models.values())

    @property
    def is_ready(self) -> bool:
        """Every model is ready (:attr:`ServedModel.is_ready`)."""
        return all(m.is_ready for m in self._models.values())

    def index(self, *, is_ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every model (only the ready ones when
        ``is_ready_only``) with its version and state, ``READY`` or ``UNAVAILABLE``."""
        entries = []
        for model in self._models.values():
            is_model_ready = model.is_ready
            if is_model_ready or not is_ready_only:
                state = "READY" if is_model_ready else "UNAVAILABLE"
                entries.append(
                    {"name": model.name, "version": model.version, "state": state, "reason": ""}
                )
        return entries


def _delay_us(max_delay_s: float | str) -> int:
    """Triton's max_queue_delay_microseconds; under "auto" the longest the adaptive
    controller may wait (MAX_AUTO_DELAY_S)."""
    if isinstance(max_delay_s, str):
        max_delay_s = MAX_AUTO_DELAY_S
    return min(round(max_delay_s * 1e6), _UINT64_MAX)
