"""A served model's result checked against its declared outputs, once per batch.

Was: an output of another shape was answered as it came (contradicting the model's
metadata), and floats where integers are declared were truncated by the cast to the wire,
without a word. Now the batch fails with a message naming the output, as Triton's
backends refuse "unexpected shape for output"."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from carpool.core.layout import Packed
from carpool.core.stepwise import is_steps, run_to_end
from carpool.server.outputs import OutputMismatch, check_outputs, checking_outputs
from carpool.server.repository import TensorSpec

OUTPUTS = (TensorSpec("Y", "FP32", (-1, 4)), TensorSpec("N", "INT64", (1,)))


def _result(**overrides: Any) -> dict[str, Any]:
    result = {"Y": np.zeros((3, 5, 4), np.float32), "N": np.zeros((3, 1), np.int64)}
    result.update(overrides)
    return result


@pytest.mark.parametrize(
    "result",
    [
        _result(),
        _result(Y=np.zeros((3, 0, 4), np.float64)),  # float64 into FP32: same kind
        _result(Y=np.zeros((3, 2, 4), np.int32)),  # integers into FP32: no value lost
        _result(N=np.zeros((3, 1), np.uint8)),
        _result(N=np.zeros((3, 1), bool)),
        {**_result(), "extra": "ignored"},
        _result(N=[np.zeros(1, np.int64)] * 3),  # one row per item, stacked per request
        _result(N=[[1], [2], [3]]),  # rows with no shape: left to the encoder, as before
    ],
)
def test_results_that_fit_the_declared_outputs_pass_unchanged(result: dict[str, Any]) -> None:
    assert check_outputs(result, OUTPUTS) is result


@pytest.mark.parametrize(
    ("datatype", "value"),
    [
        ("BYTES", ["a", "bc"]),  # str rows, the usual way to return strings
        ("BYTES", [b"a", b"bc"]),
        ("FP32", np.zeros((2, 1), ml_dtypes.bfloat16)),  # widening bfloat16 loses nothing
        ("FP16", np.zeros((2, 1), ml_dtypes.bfloat16)),
        ("BF16", np.zeros((2, 1), ml_dtypes.bfloat16)),
    ],
)
def test_lists_of_strings_and_bfloat16_pass(datatype: str, value: Any) -> None:
    """Was: refused ("the model returned list", "bfloat16 ... cannot carry"), though the
    server answered both before the checks (found in review)."""
    shape = (1,) if datatype != "BYTES" else ()
    check_outputs({"Y": value}, (TensorSpec("Y", datatype, shape),))


@pytest.mark.parametrize(
    ("result", "fragments"),
    [
        (_result(Y=np.zeros((3, 5), np.float32)), ["'Y'", "shape [3, 5]", "declared [-1, -1, 4]"]),
        (_result(Y=np.zeros((3, 5, 3), np.float32)), ["'Y'", "shape [3, 5, 3]"]),
        (_result(N=np.zeros((3, 2), np.int64)), ["'N'", "shape [3, 2]", "declared [-1, 1]"]),
        (_result(N=np.full((3, 1), 0.5)), ["'N'", "float64", "INT64", "return integers"]),
        (_result(Y=np.zeros((3, 1, 4), complex)), ["'Y'", "complex128", "FP32"]),
        (_result(Y=np.zeros((3, 1, 4), object)), ["'Y'", "object", "FP32"]),
        ({"Y": np.zeros((3, 1, 4), np.float32)}, ["no output 'N'", "['Y']", "['Y', 'N']"]),
        (_result(N=5), ["'N'", "int", "[-1, 1]", "or a list of one row per item"]),
        (_result(N=[np.zeros(2, np.int64)] * 3), ["'N'", "shape [1, 2] (one row of a list)"]),
        (_result(N=[np.full(1, 0.5)] * 3), ["'N'", "float64", "INT64"]),
        (np.zeros((3, 4)), ["ndarray", "a dict of its outputs ['Y', 'N']"]),
    ],
)
def test_a_result_that_contradicts_the_declared_outputs_names_the_output(
    result: Any, fragments: list[str]
) -> None:
    with pytest.raises(OutputMismatch) as caught:
        check_outputs(result, OUTPUTS)
    for fragment in fragments:
        assert fragment in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("datatype", "good", "bad"),
    [
        ("BOOL", np.array([[True]]), np.array([[1]])),
        ("BYTES", np.array([[b"a"]], object), np.array([[1.0]])),
        ("UINT8", np.array([[1]], np.uint8), np.array([[1.5]])),
        ("FP16", np.array([[1]], np.float16), np.array([["a"]])),
    ],
)
def test_each_datatype_takes_the_kinds_it_carries_without_loss(
    datatype: str, good: np.ndarray, bad: np.ndarray
) -> None:
    outputs = (TensorSpec("Y", datatype, (1,)),)
    check_outputs({"Y": good}, outputs)
    with pytest.raises(OutputMismatch, match=datatype):
        check_outputs({"Y": bad}, outputs)


@pytest.mark.parametrize(
    ("datatype", "value", "fits"),
    [
        ("INT32", np.array([3_000_000_000], np.int64), False),
        ("UINT8", np.array([-1], np.int64), False),
        ("UINT64", np.array([-1], np.int64), False),
        ("INT8", np.array([-128, 127], np.int64), True),
        ("UINT32", np.array([0, 4_294_967_295], np.uint64), True),
        ("INT64", np.array([True, False]), True),
        ("INT16", np.zeros(0, np.int64), True),
    ],
)
def test_integers_a_declared_integer_datatype_cannot_hold_are_refused(
    datatype: str, value: np.ndarray, fits: bool
) -> None:
    """Was: only the kind was checked, so int64 3e9 for a declared INT32 went out as
    -1294967296, and -1 for UINT8 as 255 (docs/server.md: a datatype the declared one
    carries without losing values)."""
    specs = (TensorSpec("Y", datatype, ()),)
    if fits:
        check_outputs({"Y": value}, specs)
        return
    with pytest.raises(OutputMismatch, match=f"the declared {datatype} cannot hold"):
        check_outputs({"Y": value}, specs)


def test_the_wrapper_keeps_a_model_sync_or_async() -> None:
    specs = (TensorSpec("Y", "FP32", (-1,)),)

    def sync_model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"Y": inputs["X"]}

    async def async_model(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"Y": inputs["X"][:, :1, None]}

    x = {"X": np.ones((2, 3), np.float32)}
    checked = checking_outputs(lambda device: sync_model, specs)("cpu")
    assert not asyncio.iscoroutinefunction(checked)
    assert checked(x)["Y"].shape == (2, 3)
    checked_async = checking_outputs(lambda device: async_model, specs)("cpu")
    assert asyncio.iscoroutinefunction(checked_async)
    with pytest.raises(OutputMismatch, match=r"shape \[2, 1, 1\]"):
        asyncio.run(checked_async(x))


def test_a_packed_output_is_checked_by_its_data_after_the_ragged_dimension() -> None:
    """Ragged rows come back packed: (all rows' tokens, *trailing), which must fit the
    declared dims after the ragged one."""
    outputs = (TensorSpec("T", "FP32", (-1, 3)),)
    lengths = np.array([2, 5])
    good = Packed.from_lengths(np.zeros((7, 3), np.float32), lengths)
    check_outputs({"T": good}, outputs)
    with pytest.raises(OutputMismatch, match=r"shape \[7, 4\] \(packed"):
        check_outputs({"T": Packed.from_lengths(np.zeros((7, 4), np.float32), lengths)}, outputs)
    with pytest.raises(OutputMismatch, match=r"float32.*INT64"):
        check_outputs({"T": good}, (TensorSpec("T", "INT64", (-1, 3)),))


# What the check takes: the lists a model may return and the server answers (str or
# bytes per row, a row per item), torch tensors, bfloat16 for a declared BF16 output.


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        (["a", "b"], TensorSpec("S", "BYTES", ())),
        ([b"a", b"b"], TensorSpec("S", "BYTES", ())),
        ([np.zeros(4, np.float32)] * 2, TensorSpec("Y", "FP32", (4,))),
    ],
    ids=["str-list", "bytes-list", "rows-list"],
)
def test_check_outputs_takes_lists_the_server_answers(value: object, spec: TensorSpec) -> None:
    """Was: check_outputs refuses any output without a ``shape`` (OutputMismatch "the
    model returned list"), while split_outputs and ServedModel.outputs_of answer lists."""
    assert check_outputs({spec.name: value}, (spec,)) == {spec.name: value}


def test_a_wrong_shape_is_still_refused_naming_the_output() -> None:
    """The check itself: a row of 3 for a declared [-1, 4] output fails the batch."""
    spec = TensorSpec("Y", "FP32", (4,))
    with pytest.raises(OutputMismatch, match=r"output 'Y': the model returned shape \[2, 3\]"):
        check_outputs({"Y": np.zeros((2, 3), np.float32)}, (spec,))


def test_torch_tensors_and_declared_bf16_pass_the_check() -> None:
    """Torch tensors (their dtype has no NumPy kind) and bfloat16 for a declared BF16
    output are taken as before."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    y = TensorSpec("Y", "FP32", (4,))
    b = TensorSpec("B", "BF16", (4,))
    result = {"Y": torch.zeros(2, 4), "B": np.zeros((2, 4), ml_dtypes.bfloat16)}
    assert check_outputs(result, (y, b)) is result


def test_a_model_in_steps_is_checked_when_its_last_step_returns() -> None:
    specs = (TensorSpec("Y", "FP32", (-1,)),)

    def in_steps(inputs: dict[str, np.ndarray]) -> Generator[None, None, dict[str, np.ndarray]]:
        yield
        return {"Y": inputs["X"][:, :1, None]}

    checked = checking_outputs(lambda device: in_steps, specs)("cpu")
    steps = checked({"X": np.ones((2, 3), np.float32)})
    assert is_steps(steps)  # still in steps: the loop can run between them
    with pytest.raises(OutputMismatch, match=r"shape \[2, 1, 1\]"):
        run_to_end(steps)
