"""Triton's classification extension: top classes, their strings, the parameter on both
wires, and the labels read from the config at startup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from carpool.config import load_config
from carpool.errors import ConfigError, InvalidInput
from carpool.server import grpc as grpc_codec
from carpool.server.builder import build_repository
from carpool.server.classification import (
    CLASSIFIABLE_DATATYPES,
    class_counts,
    classify,
    read_labels,
)
from carpool.server.kserve.rest_decode import decode_infer_request
from carpool.server.kserve.tensors import DATATYPES, RequestedOutput
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import TensorSpec


def _texts(array: Any) -> list[list[str]]:
    return [[element.decode() for element in row] for row in array.tolist()]


# -- the top classes ----------------------------------------------------------------------


def test_top_classes_of_the_extensions_own_example() -> None:
    # docs/protocol/extension_classification.md: [1, 5, 10, 4], top 2 -> "10:2", "5:1".
    classes = classify(np.array([[1, 5, 10, 4]], dtype=np.int32), "INT32", 2)
    assert _texts(classes) == [["10:2", "5:1"]]


def test_floats_are_written_as_cs_percent_f_with_labels() -> None:
    row = np.array([[1.1, 3.3, 0.5, 2.4]], dtype=np.float32)
    classes = classify(row, "FP32", 2, ("cat", "dog", "emu", "fox"))
    # std::to_string(float): the float32 value as a double, six decimals.
    assert _texts(classes) == [["3.300000:1:dog", "2.400000:3:fox"]]
    assert classes.dtype == object and classes.shape == (1, 2)


def test_each_row_of_a_batch_is_classified_on_its_own() -> None:
    rows = np.array([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3], [0.0, 0.0, 1.0]], dtype=np.float64)
    classes = classify(rows, "FP64", 1)
    assert _texts(classes) == [["0.900000:1"], ["0.700000:0"], ["1.000000:2"]]


def test_a_count_above_the_classes_returns_them_all() -> None:
    classes = classify(np.array([[3, 1, 2]], dtype=np.uint8), "UINT8", 10)
    assert classes.shape == (1, 3)
    assert _texts(classes) == [["3:0", "2:2", "1:1"]]


def test_every_element_of_a_row_is_a_class_in_row_major_order() -> None:
    # An output of shape [4, 1, 1] has 4 classes, as [4] has (Triton strides by row size).
    column = np.array([[[[2]], [[9]], [[4]], [[7]]]], dtype=np.int64)
    assert column.shape == (1, 4, 1, 1)
    assert _texts(classify(column, "INT64", 2)) == [["9:1", "7:3"]]


def test_equal_values_keep_the_lower_index_first_and_nan_ranks_last() -> None:
    row = np.array([[1.0, np.nan, 2.0, 1.0, 2.0]], dtype=np.float32)
    assert _texts(classify(row, "FP32", 5)) == [
        ["2.000000:2", "2.000000:4", "1.000000:0", "1.000000:3", "nan:1"]
    ]


@pytest.mark.parametrize("datatype", ["INT8", "INT64", "UINT8", "UINT64"])
def test_integer_extremes_order_without_overflow(datatype: str) -> None:
    info = np.iinfo(DATATYPES[datatype])
    row = np.array([[0, info.min, info.max, 1]], dtype=DATATYPES[datatype])
    expected = sorted([0, int(info.min), int(info.max), 1], reverse=True)
    texts = [text.split(":")[0] for text in _texts(classify(row, datatype, 4))[0]]
    assert texts == [str(value) for value in expected]


def test_values_are_compared_in_the_outputs_datatype() -> None:
    # A model that returns float64 for an FP32 output: compared as FP32, where both are
    # 0.1f (a tie: the lower index first); as float64 index 1 would be the larger.
    row = np.array([[0.1, 0.1000000001]], dtype=np.float64)
    assert _texts(classify(row, "FP32", 2)) == [["0.100000:0", "0.100000:1"]]
    assert _texts(classify(row, "FP64", 2)) == [["0.100000:1", "0.100000:0"]]


def test_labels_missing_or_empty_add_nothing() -> None:
    row = np.array([[3, 2, 1]], dtype=np.int16)
    assert _texts(classify(row, "INT16", 3, ("a", ""))) == [["3:0:a", "2:1", "1:2"]]


def test_a_batch_of_no_rows_has_no_classes() -> None:
    classes = classify(np.zeros((0, 5), dtype=np.float32), "FP32", 2)
    assert classes.shape == (0, 2)


# -- the classification parameter ---------------------------------------------------------


def _rest_outputs(parameters: dict[str, Any]) -> tuple[RequestedOutput, ...] | None:
    body = orjson.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "outputs": [{"name": "y", "parameters": parameters}],
        }
    )
    return decode_infer_request(body, None).outputs


def test_rest_classification_parameter_is_read_with_binary_data() -> None:
    outputs = _rest_outputs({"classification": 3, "binary_data": True})
    assert outputs == (RequestedOutput("y", is_binary=True, class_count=3),)
    assert _rest_outputs({}) == (RequestedOutput("y", is_binary=False, class_count=0),)


def test_rest_classification_zero_asks_for_the_tensor_as_triton_reads_it() -> None:
    # Triton's REST endpoint takes the count as given and 0 is its default: no classes.
    outputs = _rest_outputs({"classification": 0, "binary_data": True})
    assert outputs == (RequestedOutput("y", is_binary=True, class_count=0),)


@pytest.mark.parametrize("value", [-2, True, 2.5, "3", [3]])
def test_rest_bad_classification_names_the_output_value_and_expected(value: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        _rest_outputs({"classification": value})
    message = str(caught.value)
    assert "output 'y'" in message
    assert f"classification={value!r}" in message
    assert "integer >= 0" in message


def _grpc_outputs(set_parameter: Any) -> tuple[RequestedOutput, ...] | None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    set_parameter(request.outputs.add(name="y").parameters["classification"])
    return grpc_codec.decode_infer_request(request).outputs


def test_grpc_classification_parameter_is_an_int64_param() -> None:
    def three(parameter: pb.InferParameter) -> None:
        parameter.int64_param = 3

    assert _grpc_outputs(three) == (RequestedOutput("y", is_binary=True, class_count=3),)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("int64_param", 0, "classification=0"),
        ("int64_param", -1, "classification=-1"),
        ("string_param", "3", "string_param '3'"),
        ("uint64_param", 3, "uint64_param 3"),
        ("bool_param", True, "bool_param True"),
    ],
)
def test_grpc_bad_classification_names_the_output_value_and_expected(
    field: str, value: Any, fragment: str
) -> None:
    def bad(parameter: pb.InferParameter) -> None:
        setattr(parameter, field, value)

    with pytest.raises(InvalidInput) as caught:
        _grpc_outputs(bad)
    message = str(caught.value)
    assert "output 'y'" in message
    assert fragment in message
    assert ">= 1" in message


@pytest.mark.parametrize("datatype", sorted(set(DATATYPES) - set(CLASSIFIABLE_DATATYPES)))
def test_an_output_that_cannot_be_classified_is_refused(datatype: str) -> None:
    # As Triton's TopkClassifications: BOOL, BYTES, FP16 (and BF16) have no top classes.
    spec = TensorSpec("y", datatype, (4,))
    with pytest.raises(InvalidInput) as caught:
        class_counts((RequestedOutput("y", True, 2),), [spec])
    message = str(caught.value)
    assert "output 'y'" in message and "classification=2" in message
    assert f"datatype {datatype}" in message and "FP32" in message


def test_no_classification_asked_is_none() -> None:
    spec = TensorSpec("y", "BYTES", (4,))
    assert class_counts(None, [spec]) is None
    assert class_counts((RequestedOutput("y", True),), [spec]) is None


# -- labels -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "labels"),
    [
        ("a\nb\n", ("a", "b")),
        ("a\nb", ("a", "b")),
        ("a\r\nb\r\n", ("a", "b")),
        ("a\n\nc\n", ("a", "", "c")),
        ("", ()),
        ("chat noir\nünïcode\n", ("chat noir", "ünïcode")),
    ],
)
def test_label_file_has_one_label_per_line(tmp_path: Path, text: str, labels: tuple[str]) -> None:
    path = tmp_path / "labels.txt"
    path.write_bytes(text.encode("utf-8"))
    assert read_labels(path) == labels


def _serve_yaml(tmp_path: Path, output: str, *, input_extra: str = "") -> Path:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "models:\n"
        "  - name: m\n"
        "    kind: python\n"
        "    source: numpy:copy\n"
        f"    inputs: [{{name: X, datatype: FP32, shape: [3]{input_extra}}}]\n"
        f"    outputs: [{output}]\n",
        encoding="utf-8",
    )
    return config


def _build(config: Path) -> Any:
    return build_repository(load_config(config), file=str(config))


def test_labels_are_read_relative_to_the_config_and_shown_in_its_model_config(
    tmp_path: Path,
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "labels.txt").write_text("cat\ndog\nemu\n", encoding="utf-8")
    output = "{name: Y, datatype: FP32, shape: [3], label_filename: sub/labels.txt}"
    model = _build(_serve_yaml(tmp_path, output)).get("m")
    assert model.outputs[0].labels == ("cat", "dog", "emu")
    entry = model.config()["output"][0]
    assert entry["label_filename"] == "sub/labels.txt"
    assert grpc_codec.model_config(model).output[0].label_filename == "sub/labels.txt"
    assert "label_filename" not in model.config()["input"][0]


def test_a_missing_label_file_names_the_key_and_path(tmp_path: Path) -> None:
    output = "{name: Y, datatype: FP32, shape: [3], label_filename: nope.txt}"
    config = _serve_yaml(tmp_path, output)
    with pytest.raises(ConfigError) as caught:
        _build(config)
    message = str(caught.value)
    assert message.startswith(f"{config}: invalid models[0].outputs[0].label_filename='nope.txt'")
    assert str(tmp_path / "nope.txt") in message and "No such file" in message


def test_a_label_file_shorter_than_the_classes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("cat\ndog\n", encoding="utf-8")
    output = "{name: Y, datatype: FP32, shape: [3, 1], label_filename: labels.txt}"
    with pytest.raises(ConfigError) as caught:
        _build(_serve_yaml(tmp_path, output))
    message = str(caught.value)
    assert "models[0].outputs[0].label_filename" in message
    assert "at least 3" in message and "has 2 line(s)" in message


def test_a_label_file_not_in_utf8_is_refused(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_bytes(b"caf\xe9\n")
    output = "{name: Y, datatype: FP32, shape: [1], label_filename: labels.txt}"
    with pytest.raises(ConfigError) as caught:
        _build(_serve_yaml(tmp_path, output))
    assert "is not UTF-8" in str(caught.value)


def test_an_output_of_any_size_takes_any_number_of_labels(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("cat\n", encoding="utf-8")
    output = "{name: Y, datatype: FP32, shape: [-1], label_filename: labels.txt}"
    assert _build(_serve_yaml(tmp_path, output)).get("m").outputs[0].labels == ("cat",)


def test_an_input_takes_no_labels(tmp_path: Path) -> None:
    output = "{name: Y, datatype: FP32, shape: [3]}"
    config = _serve_yaml(tmp_path, output, input_extra=", label_filename: labels.txt")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert "models[0].inputs[0].label_filename" in str(caught.value)
    assert "only outputs" in str(caught.value)
