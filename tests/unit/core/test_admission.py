"""Admission checks, called directly: each names what was wrong and what was expected."""

from __future__ import annotations

import math

import numpy as np
import pytest

from carpool import BatchPolicy, ClassPolicy, InvalidInput
from carpool.core.admission import deadline, inspect_payload, request_cost
from carpool.core.collate import (
    DictCollator,
    ListCollator,
    NumpyCollator,
    PackedCollator,
    PaddedCollator,
    TorchCollator,
)


def test_inspect_counts_items_along_axis_0_and_signs_by_trailing_shape() -> None:
    items, signature = inspect_payload(NumpyCollator(), np.ones((3, 4), np.float32), True)
    assert items == 3
    assert signature == inspect_payload(NumpyCollator(), np.zeros((5, 4), np.float32), True)[1]


def test_inspect_refuses_zero_items_and_unbatchable_payloads() -> None:
    with pytest.raises(InvalidInput, match="0 items"):
        inspect_payload(ListCollator(), [], True)
    with pytest.raises(InvalidInput, match=r"cannot be batched.*inhomogeneous"):
        inspect_payload(NumpyCollator(), [[1], [2, 3]], True)  # ragged rows
    # A collator whose signature reads the first item: was "IndexError: list index out of
    # range"; an empty dict was "inputs disagree on the batch dimension: []".
    for collator in (PackedCollator(), PaddedCollator()):
        with pytest.raises(InvalidInput, match="submit_many got 0 items"):
            inspect_payload(collator, [], True)
    with pytest.raises(InvalidInput, match="an empty dict"):
        inspect_payload(DictCollator(), {}, True)


def test_torch_collation_refuses_what_is_not_a_tensor_at_submit() -> None:
    """Was: a NumPy item got its own group and failed in torch.stack, reported as "the
    model raised" although the model never saw it."""
    import torch

    collator = TorchCollator()
    assert inspect_payload(collator, torch.ones(3), False)[0] == 1
    with pytest.raises(InvalidInput, match=r"collate='torch' takes torch.Tensor items"):
        inspect_payload(collator, np.ones(3, np.float32), False)


@pytest.mark.parametrize(
    ("collator", "payload", "shown"),
    [
        (ListCollator(), 5, "int 5"),
        (ListCollator(), None, "NoneType None"),
        (NumpyCollator(), np.float32(3), "float32"),
        (NumpyCollator(), np.array(2.0), "ndarray array(2.)"),
    ],
)
def test_submit_many_without_an_axis_0_names_the_payload_and_submit(
    collator: object, payload: object, shown: str
) -> None:
    """Was: "payload cannot be batched (TypeError: object of type 'int' has no len())",
    which names neither the call, the payload nor what it expects."""
    with pytest.raises(InvalidInput) as caught:
        inspect_payload(collator, payload, True)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith(f"submit_many got {shown}")
    assert "expected k items along axis 0" in message and "use submit()" in message


def test_cost_defaults_to_items_then_cost_fn_then_the_keyword() -> None:
    policy = BatchPolicy(max_batch_size=8, max_batch_cost=100.0)
    limits = policy.class_limits(None)
    assert request_cost(policy, limits, "abc", 2, None) == 2.0
    priced = policy.replace(cost_fn=len)
    assert request_cost(priced, priced.class_limits(None), "abc", 1, None) == 3.0
    assert request_cost(priced, priced.class_limits(None), "abc", 1, 7) == 7.0


@pytest.mark.parametrize(
    ("num_items", "cost", "fragment"),
    [(9, None, "more than max_batch_size=8"), (1, 101.0, "max_batch_cost=100"), (1, -1, "cost=")],
)
def test_cost_refuses_what_could_never_fit(
    num_items: int, cost: float | None, fragment: str
) -> None:
    policy = BatchPolicy(max_batch_size=8, max_batch_cost=100.0)
    with pytest.raises(InvalidInput, match=fragment):
        request_cost(policy, policy.class_limits(None), None, num_items, cost)


def test_deadline_uses_the_class_default_and_validates_the_keyword() -> None:
    policy = BatchPolicy(classes=(ClassPolicy("only", timeout_s=2.0),), default_class="only")
    limits = policy.class_limits(None)
    assert deadline(10.0, None, limits) == 12.0
    assert deadline(10.0, 0.5, limits) == 10.5
    assert deadline(10.0, None, BatchPolicy().class_limits(None)) is None
    for bad in (0, -1.0, math.inf, True):
        with pytest.raises(InvalidInput, match="timeout_s"):
            deadline(10.0, bad, limits)
