"""Served-model checks: declared tensors, request parameters, metadata and config."""

from __future__ import annotations

import asyncio
import re
import threading

import numpy as np
import pytest

from carpool import Batcher, BatchPolicy, ClassPolicy, ConfigError, DeadlineExceeded, InvalidInput
from carpool.core.clock import FakeClock
from carpool.core.collate import DictCollator
from carpool.server.errors import NotFound, http_error
from carpool.server.kserve.tensors import InferRequest, InputTensor
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec


def _model(name: str = "m") -> ServedModel:
    batcher = Batcher(
        lambda inputs: {"y": inputs["x"]}, BatchPolicy(max_batch_size=8), collate="dict"
    )
    return ServedModel(
        name=name,
        version="1",
        platform="python",
        inputs=(TensorSpec("x", "FP32", (-1, 4)),),
        outputs=(TensorSpec("y", "FP32", (-1, 4)),),
        batcher=batcher,
    )


def _request(*tensors: InputTensor, **parameters: object) -> InferRequest:
    return InferRequest(
        request_id=None,
        inputs=tensors,
        outputs=None,
        parameters=dict(parameters),
        is_binary_output_default=False,
    )


def _tensor(shape: tuple[int, ...], datatype: str = "FP32", name: str = "x") -> InputTensor:
    dtype = np.float32 if datatype == "FP32" else np.float64
    return InputTensor(name, datatype, shape, np.zeros(shape, dtype))


def test_payload_accepts_declared_shapes_with_wildcards() -> None:
    payload = _model().payload(_request(_tensor((2, 7, 4))))
    assert payload["x"].shape == (2, 7, 4)


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        (_tensor((2, 7, 5)), "shape [2, 7, 5], expected [-1, -1, 4]"),
        (_tensor((2, 7, 4), "FP64"), "datatype FP64, expected FP32"),
        (_tensor((2, 4), name="z"), "unknown input 'z'"),
        (_tensor((0, 7, 4)), "batch dimension is 0"),
    ],
)
def test_payload_rejects_what_does_not_match_naming_it(tensor: InputTensor, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        _model().payload(_request(tensor))


def test_inputs_that_disagree_on_the_batch_dimension_are_refused_as_the_collator_does() -> None:
    """The one check of the batch dimension (core's shared_rows): the payload of a request
    is refused with the message the batcher's dict collator gives a Python caller."""
    spec = TensorSpec("b", "FP32", (4,))
    model = ServedModel(
        "m", "1", "python", (*_model().inputs, spec), _model().outputs, _model().batcher
    )
    request = _request(_tensor((2, 7, 4)), _tensor((3, 4), name="b"))
    with pytest.raises(InvalidInput) as refused:
        model.payload(request)
    assert str(refused.value) == "inputs disagree on the batch dimension: [2, 3]"
    arrays = {tensor.name: tensor.array for tensor in request.inputs}
    with pytest.raises(InvalidInput, match=re.escape(str(refused.value))):
        DictCollator().num_items(arrays)


def test_missing_input_is_named() -> None:
    with pytest.raises(InvalidInput, match="missing input 'x'"):
        _model().payload(_request())


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, {}),
        ({"priority": 1}, {"priority": "interactive"}),
        ({"priority": 3}, {"priority": "background"}),
        ({"priority": 0}, {}),
        ({"priority": 4}, {}),  # beyond the levels: the default, as Triton
        ({"timeout": 0}, {}),  # no timeout of its own, as Triton
        ({"priority": "normal"}, {"priority": "normal"}),
        ({"timeout": 250_000}, {"timeout_s": 0.25}),
    ],
)
def test_priority_and_timeout_parameters_map_to_classes_and_deadlines(
    parameters: dict[str, object], expected: dict[str, object]
) -> None:
    assert _model().submit_options(_request(**parameters)) == pytest.approx(expected)


def _model_with_class_deadlines() -> ServedModel:
    model = _model()
    model.batcher.update_policy(
        classes=(
            ClassPolicy("interactive", timeout_s=0.1),
            ClassPolicy("normal", timeout_s=1.0),
            ClassPolicy("background"),
        ),
        default_class="normal",
    )
    return model


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({"timeout": 200_000}, {"timeout_s": 0.2}),  # shorter than the class's 1 s
        ({"timeout": 5_000_000}, {}),  # longer: the class's 1 s applies
        ({"timeout": 1_000_000}, {}),  # equal: the class's own
        ({"priority": 1, "timeout": 50_000}, {"priority": "interactive", "timeout_s": 0.05}),
        ({"priority": 1, "timeout": 200_000}, {"priority": "interactive"}),
        ({"priority": 3, "timeout": 5_000_000}, {"priority": "background", "timeout_s": 5.0}),
        ({"priority": "gold", "timeout": 5_000_000}, {"priority": "gold", "timeout_s": 5.0}),
    ],
)
def test_a_requests_timeout_shortens_its_class_deadline_and_never_lengthens_it(
    parameters: dict[str, object], expected: dict[str, object]
) -> None:
    """Was: a request's ``timeout`` replaced its class's ``timeout_s``, so a client could
    keep a request queued past the deadline the operator set, while ``/config`` said
    ``allow_timeout_override: true``, which in Triton only shortens. A class with no
    deadline takes any timeout; an unknown class name is left for the batcher to refuse."""
    options = _model_with_class_deadlines().submit_options(_request(**parameters))
    assert options == pytest.approx(expected)


def test_a_longer_timeout_expires_at_the_class_deadline() -> None:
    """End to end in the batcher: the request asks for 5 s, its class allows 0.1 s, and it
    expires while the only replica is busy."""
    clock = FakeClock()
    entered, gate = threading.Event(), threading.Event()

    def model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        entered.set()
        gate.wait(5.0)
        return {"y": inputs["x"]}

    served = ServedModel(
        name="m",
        version="1",
        platform="python",
        inputs=(TensorSpec("x", "FP32", (-1, 4)),),
        outputs=(TensorSpec("y", "FP32", (-1, 4)),),
        batcher=Batcher(
            model,
            BatchPolicy(max_batch_size=1, classes=(ClassPolicy("normal", timeout_s=0.1),)),
            collate="dict",
            executor="thread",
            clock=clock,
        ),
    )
    x = np.zeros((1, 4), np.float32)

    async def run() -> None:
        async with served.batcher:
            blocker = asyncio.ensure_future(served.batcher.submit({"x": x}))
            assert await asyncio.to_thread(entered.wait, 5.0)  # the only replica is busy
            options = served.submit_options(_request(timeout=5_000_000))
            waiting = asyncio.ensure_future(served.batcher.submit({"x": x}, **options))
            await clock.advance(0.09)
            assert not waiting.done()
            await clock.advance(0.02)  # past the class's 0.1 s, long before the request's 5 s
            with pytest.raises(DeadlineExceeded):
                await asyncio.wait_for(waiting, 5.0)
            gate.set()
            await blocker

    asyncio.run(run())


@pytest.mark.parametrize(
    "parameters", [{"priority": -1}, {"priority": 1.5}, {"timeout": -1}, {"timeout": True}]
)
def test_bad_priority_or_timeout_is_invalid_input(parameters: dict[str, object]) -> None:
    with pytest.raises(InvalidInput):
        _model().submit_options(_request(**parameters))


def test_metadata_and_config_show_the_batch_dimension_and_policy() -> None:
    model = _model()
    assert model.metadata()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 4]}]
    config = model.config()
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1, 4]}]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 5000


def test_repository_finds_models_and_versions_or_says_what_exists() -> None:
    repo = ModelRepository([_model("a"), _model("b")])
    assert repo.get("a").name == "a"
    assert repo.get("a", "1").name == "a"
    with pytest.raises(NotFound, match="available: a, b"):
        repo.get("c")
    with pytest.raises(NotFound, match="version '2'"):
        repo.get("a", "2")
    with pytest.raises(ConfigError):
        ModelRepository([_model("a"), _model("a")])


def test_unknown_datatype_in_a_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="datatype"):
        TensorSpec("x", "FP8", (4,))


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidInput("bad"), 400),
        (NotFound("model 'x'", []), 404),
        (ConfigError("f", 1, "2"), 400),
        (RuntimeError("boom"), 500),
    ],
)
def test_errors_map_to_http_statuses(error: Exception, status: int) -> None:
    assert http_error(error).status == status


def test_queue_full_says_when_to_retry() -> None:
    from carpool import QueueFull

    mapped = http_error(QueueFull("normal", 10))
    assert mapped.status == 429
    assert (b"retry-after", b"1") in mapped.headers


def test_outputs_of_stacks_the_rows_of_per_token_outputs() -> None:
    """Ragged rows' per-token outputs come back from the split as lists of rows; the
    result itself was checked against the declared outputs once, per batch."""
    rows = [np.zeros(4, np.float32), np.ones(4, np.float32)]
    outputs = _model().outputs_of({"y": rows, "n": np.array([2])})
    assert outputs["y"].shape == (2, 4) and outputs["y"][1].tolist() == [1.0] * 4
    assert outputs["n"].tolist() == [2]
