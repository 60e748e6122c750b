"""What the output checks (``carpool.server.outputs.check_outputs``) take: the lists a
model may return and the server answers (str or bytes per row, a row per item), torch
tensors, bfloat16 for a declared BF16 output; and a wrong shape, refused naming the output.

Served end to end in tests/integration/test_output_checks.py."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.server.outputs import OutputMismatch, check_outputs
from carpool.server.repository import TensorSpec


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
