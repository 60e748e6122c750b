"""Collators join payloads into one batch and split the model's outputs back per request."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from carpool import ConfigError
from carpool.core.collate import (
    ListCollator,
    NumpyCollator,
    OutputCountMismatch,
    TorchCollator,
    collator_for,
    split_outputs,
)

# -- ListCollator --------------------------------------------------------------------------


def test_list_collator_keeps_single_items_as_a_list() -> None:
    assert ListCollator().collate(["a", "b", "c"], [False, False, False]) == ["a", "b", "c"]


def test_list_collator_flattens_many_requests_in_order() -> None:
    batch = ListCollator().collate(["a", ["b", "c"], "d"], [False, True, False])
    assert batch == ["a", "b", "c", "d"]


def test_list_collator_counts_items_of_a_many_request() -> None:
    assert ListCollator().num_items(["x", "y", "z"]) == 3


def test_list_collator_splits_one_output_per_single_request() -> None:
    assert ListCollator().split([10, 20, 30], [1, 1, 1], [False, False, False]) == [10, 20, 30]


def test_list_collator_splits_many_requests_into_their_own_rows() -> None:
    results = ListCollator().split([1, 2, 3, 4], [1, 2, 1], [False, True, False])
    assert results == [1, [2, 3], 4]


def test_list_collator_splits_a_many_request_of_one_item_into_a_list() -> None:
    assert ListCollator().split([7, 8], [1, 1], [True, False]) == [[7], 8]


# -- NumpyCollator -------------------------------------------------------------------------


def test_numpy_collator_stacks_single_items_along_a_new_axis() -> None:
    items = [np.full(3, i, dtype=np.float32) for i in range(4)]
    batch = NumpyCollator().collate(items, [False] * 4)
    assert batch.shape == (4, 3)
    assert batch.dtype == np.float32
    np.testing.assert_array_equal(batch[2], items[2])


def test_numpy_collator_concatenates_many_requests_along_axis_zero() -> None:
    single = np.array([1.0, 1.0])
    many = np.array([[2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    batch = NumpyCollator().collate([single, many, single * 5], [False, True, False])
    np.testing.assert_array_equal(batch, [[1, 1], [2, 2], [3, 3], [4, 4], [5, 5]])


def test_numpy_collator_splits_back_to_rows_and_row_blocks() -> None:
    outputs = np.arange(10).reshape(5, 2)
    single, many, last = NumpyCollator().split(outputs, [1, 3, 1], [False, True, False])
    np.testing.assert_array_equal(single, [0, 1])
    np.testing.assert_array_equal(many, [[2, 3], [4, 5], [6, 7]])
    np.testing.assert_array_equal(last, [8, 9])


def test_numpy_collator_round_trips_mixed_requests() -> None:
    rng = np.random.default_rng(0)
    payloads: list[Any] = [rng.random(4), rng.random((2, 4)), rng.random(4), rng.random((3, 4))]
    is_many = [False, True, False, True]
    collator = NumpyCollator()
    counts = [collator.num_items(p) if m else 1 for p, m in zip(payloads, is_many, strict=True)]
    assert counts == [1, 2, 1, 3]
    outputs = collator.collate(payloads, is_many) * 2
    for payload, result in zip(payloads, collator.split(outputs, counts, is_many), strict=True):
        np.testing.assert_array_equal(result, payload * 2)


def test_numpy_signature_separates_dtypes_and_shapes_but_not_counts() -> None:
    collator = NumpyCollator()
    one = collator.signature(np.zeros(3, np.float32), False)
    assert one == collator.signature(np.ones(3, np.float32), False)
    assert one != collator.signature(np.zeros(3, np.float64), False)
    assert one != collator.signature(np.zeros(4, np.float32), False)
    assert one == collator.signature(np.zeros((5, 3), np.float32), True)


# -- TorchCollator -------------------------------------------------------------------------


def test_torch_collator_stacks_single_tensors() -> None:
    items = [torch.full((3,), float(i)) for i in range(4)]
    batch = TorchCollator().collate(items, [False] * 4)
    assert isinstance(batch, torch.Tensor)
    assert tuple(batch.shape) == (4, 3)
    assert torch.equal(batch[3], items[3])


def test_torch_collator_concatenates_many_requests() -> None:
    single = torch.tensor([1.0])
    many = torch.tensor([[2.0], [3.0]])
    batch = TorchCollator().collate([single, many], [False, True])
    assert torch.equal(batch, torch.tensor([[1.0], [2.0], [3.0]]))


def test_torch_collator_splits_back_per_request() -> None:
    outputs = torch.arange(8).reshape(4, 2)
    results = TorchCollator().split(outputs, [1, 2, 1], [False, True, False])
    assert torch.equal(results[0], torch.tensor([0, 1]))
    assert torch.equal(results[1], torch.tensor([[2, 3], [4, 5]]))
    assert torch.equal(results[2], torch.tensor([6, 7]))


def test_torch_collator_counts_items_and_signs_dtype_shape_device() -> None:
    collator = TorchCollator()
    assert collator.num_items(torch.zeros(5, 2)) == 5
    signature = collator.signature(torch.zeros(2, dtype=torch.float16), False)
    assert signature == ("torch.float16", (2,), "cpu")
    assert collator.signature(torch.zeros(7, 2, dtype=torch.float16), True) == signature


# -- several outputs -----------------------------------------------------------------------


def test_tuple_outputs_are_split_per_output() -> None:
    logits = np.arange(4)
    embeddings = np.arange(8).reshape(4, 2)
    results = split_outputs((logits, embeddings), [1, 2, 1], [False, True, False])
    assert len(results) == 3
    assert all(isinstance(r, tuple) and len(r) == 2 for r in results)
    assert results[0][0] == 0
    np.testing.assert_array_equal(results[0][1], [0, 1])
    np.testing.assert_array_equal(results[1][0], [1, 2])
    np.testing.assert_array_equal(results[1][1], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(results[2][1], [6, 7])


def test_dict_outputs_are_split_per_key() -> None:
    outputs = {"label": ["a", "b", "c"], "score": np.array([0.1, 0.2, 0.3])}
    results = split_outputs(outputs, [1, 1, 1], [False, False, False])
    assert [r["label"] for r in results] == ["a", "b", "c"]
    assert [float(r["score"]) for r in results] == [0.1, 0.2, 0.3]
    assert all(set(r) == {"label", "score"} for r in results)


def test_dict_outputs_split_many_requests_per_key() -> None:
    outputs = {"ids": torch.arange(3), "mask": [True, False, True]}
    first, rest = split_outputs(outputs, [1, 2], [False, True])
    assert int(first["ids"]) == 0
    assert first["mask"] is True
    assert torch.equal(rest["ids"], torch.tensor([1, 2]))
    assert rest["mask"] == [False, True]


# -- mismatches ----------------------------------------------------------------------------


def test_too_few_outputs_is_a_mismatch_naming_both_counts() -> None:
    with pytest.raises(OutputCountMismatch) as excinfo:
        NumpyCollator().split(np.zeros((3, 2)), [1, 1, 1, 1], [False] * 4)
    assert (excinfo.value.expected, excinfo.value.got) == (4, 3)
    message = str(excinfo.value)
    assert "3 outputs" in message
    assert "4 items" in message
    assert "one output per input item" in message


def test_too_many_outputs_with_many_requests_is_a_mismatch() -> None:
    with pytest.raises(OutputCountMismatch) as excinfo:
        ListCollator().split([1, 2, 3, 4, 5, 6], [2, 3], [True, True])
    assert (excinfo.value.expected, excinfo.value.got) == (5, 6)


@pytest.mark.parametrize("scalar", [np.float32(1.5), np.array(2.0), torch.tensor(3.0), 7, None])
def test_scalar_output_is_a_mismatch(scalar: object) -> None:
    with pytest.raises(OutputCountMismatch) as excinfo:
        split_outputs(scalar, [1, 1], [False, False])
    assert excinfo.value.expected == 2
    assert "no length along axis 0" in str(excinfo.value)
    assert "2 items" in str(excinfo.value)


def test_mismatch_inside_a_tuple_names_the_output() -> None:
    with pytest.raises(OutputCountMismatch, match=r"in output '\[1\]'") as excinfo:
        split_outputs((np.zeros(2), np.zeros(3)), [1, 1], [False, False])
    assert (excinfo.value.expected, excinfo.value.got) == (2, 3)


def test_mismatch_inside_a_dict_names_the_key() -> None:
    with pytest.raises(OutputCountMismatch, match="in output 'score'"):
        split_outputs({"label": [1, 2], "score": [0.5]}, [1, 1], [False, False])


# -- choosing a collator -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "kind"),
    [
        (np.zeros(3), NumpyCollator),
        (torch.zeros(3), TorchCollator),
        ([1, 2, 3], ListCollator),
        ("text", ListCollator),
        ({"a": 1}, ListCollator),
        (None, ListCollator),
    ],
)
def test_auto_picks_collator_by_payload_type(sample: object, kind: type) -> None:
    assert type(collator_for("auto", sample)) is kind


@pytest.mark.parametrize(
    ("name", "kind"), [("list", ListCollator), ("numpy", NumpyCollator), ("torch", TorchCollator)]
)
def test_named_collators_ignore_the_sample(name: str, kind: type) -> None:
    assert type(collator_for(name, [1])) is kind


def test_a_collator_object_is_used_as_given() -> None:
    collator = NumpyCollator()
    assert collator_for(collator, torch.zeros(1)) is collator


def test_unknown_collator_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as excinfo:
        collator_for("pandas", None)
    assert excinfo.value.field == "collate"
    assert "'auto', 'list', 'numpy', 'torch'" in str(excinfo.value)


def test_importing_carpool_core_does_not_import_torch() -> None:
    code = (
        "import sys, carpool, carpool.core, carpool.core.collate, carpool.core.batcher\n"
        "from carpool.core.collate import collator_for\n"
        "import numpy as np\n"
        "collator_for('auto', np.zeros(2)).collate([np.zeros(2)], [False])\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr


# -- named inputs (DictCollator) ----------------------------------------------------------


def test_dict_collator_concatenates_each_input_and_splits_dict_outputs() -> None:
    from carpool.core.collate import DictCollator

    collator = DictCollator()
    first = {"a": np.ones((2, 3), np.float32), "b": np.zeros((2,), np.int64)}
    second = {"a": np.full((1, 3), 2, np.float32), "b": np.ones((1,), np.int64)}
    assert collator.num_items(first) == 2
    assert collator.signature(first, True) == collator.signature(second, True)
    batch = collator.collate([first, second], [True, True])
    assert batch["a"].shape == (3, 3) and batch["b"].tolist() == [0, 0, 1]
    outputs = {"y": batch["a"].sum(axis=1)}
    parts = collator.split(outputs, [2, 1], [True, True])
    assert [p["y"].tolist() for p in parts] == [[3.0, 3.0], [6.0]]


def test_dict_collator_refuses_inputs_that_disagree_on_the_batch_dimension() -> None:
    from carpool.core.collate import DictCollator

    with pytest.raises(ValueError, match="batch dimension"):
        DictCollator().num_items({"a": np.ones((2, 3)), "b": np.ones((3,))})


def test_auto_picks_the_dict_collator_for_named_arrays() -> None:
    from carpool.core.collate import DictCollator

    assert isinstance(collator_for("auto", {"x": np.ones(3)}), DictCollator)
