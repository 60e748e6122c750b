"""The records a front-end worker and the engine exchange."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.errors import DeadlineExceeded, InvalidInput, QueueFull
from carpool.server.errors import http_error
from carpool.server.kserve.tensors import DATATYPES
from carpool.server.workers.records import (
    Kind,
    decode,
    decode_error,
    encode,
    encode_error,
    encode_group,
    group_key,
    split_group,
)


def _through(parts: list[bytes | memoryview]) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in parts))


def _sample(datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([[b"ab", b""], [b"\x00\xff", "text"]], dtype=object)
    return (np.arange(6).reshape(2, 3) % 2).astype(DATATYPES[datatype])


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_arrays_of_every_kserve_datatype_round_trip(datatype: str) -> None:
    array = _sample(datatype)
    record = decode(_through(encode(Kind.INFER, {"id": 7}, {"IN": array})))
    out = record.arrays["IN"]
    assert out.dtype == array.dtype and out.shape == array.shape
    assert out.tolist() == array.tolist()
    assert record.header == {"id": 7, "kind": int(Kind.INFER)}


def test_several_arrays_and_a_blob_keep_their_order_and_bytes() -> None:
    arrays = {"A": np.zeros((0, 4), np.float32), "B": np.arange(3, dtype=">i4")}
    record = decode(_through(encode(Kind.FORWARD, {"id": 1}, arrays, b"body")))
    assert list(record.arrays) == ["A", "B"]
    assert record.arrays["A"].shape == (0, 4)
    assert record.arrays["B"].tolist() == [0, 1, 2]
    assert bytes(record.blob) == b"body"
    assert record.kind is Kind.FORWARD


def test_decoded_arrays_are_writable_views() -> None:
    record = decode(_through(encode(Kind.RESULT, {"id": 1}, {"O": np.ones(4, np.float32)})))
    record.arrays["O"][0] = 5  # torch.from_numpy warns on a read-only array
    assert record.arrays["O"][0] == 5


def test_a_strided_array_is_sent_as_its_values() -> None:
    array = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    record = decode(_through(encode(Kind.INFER, {"id": 1}, {"X": array})))
    assert record.arrays["X"].tolist() == array.tolist()


@pytest.mark.parametrize(
    "error",
    [QueueFull("normal", 4), DeadlineExceeded(3, 0.5, 0.7), InvalidInput("bad row")],
    ids=["queue-full", "deadline", "invalid"],
)
def test_carpool_errors_come_back_with_their_status_message_and_headers(error: Exception) -> None:
    back = decode_error(encode_error(error))
    assert type(back) is type(error)
    assert http_error(back) == http_error(error)


def test_another_exception_comes_back_named_as_its_type() -> None:
    back = decode_error(encode_error(ZeroDivisionError("division by zero")))
    assert http_error(back).status == 500
    assert http_error(back).message == "internal error: ZeroDivisionError: division by zero"


def test_a_group_gives_each_item_its_own_rows_of_each_array() -> None:
    arrays = [
        {"A": np.arange(i * 6, i * 6 + 3 * (i + 1), dtype=np.float32).reshape(-1, 3),
         "B": np.full((i % 2 + 1,), i, dtype=np.int64)}
        for i in range(3)
    ]  # fmt: skip
    items = [{"id": 10 + i} for i in range(3)]
    record = decode(_through(encode_group(Kind.INFERS, items, arrays)))
    assert record.kind is Kind.INFERS
    split = split_group(record)
    assert [item for item, _ in split] == items
    for (_, got), sent in zip(split, arrays, strict=True):
        assert list(got) == ["A", "B"]
        for name in sent:
            assert got[name].dtype == sent[name].dtype
            assert got[name].tolist() == sent[name].tolist()


def test_a_group_of_one_round_trips() -> None:
    arrays = {"O": np.eye(2, dtype=np.float64)}
    [(item, got)] = split_group(decode(_through(encode_group(Kind.RESULTS, [5], [arrays]))))
    assert item == 5 and got["O"].tolist() == arrays["O"].tolist()


def test_only_arrays_that_can_be_joined_have_a_group_key() -> None:
    a = np.zeros((2, 3), np.float32)
    assert group_key({"A": a}) == (("A", "<f4", (3,)),)
    assert group_key({"A": a}) != group_key({"A": a.astype(np.float64)})
    assert group_key({"A": a}) != group_key({"A": np.zeros((2, 4), np.float32)})
    assert group_key({"A": np.array([b"x"], dtype=object)}) is None
    assert group_key({"A": np.float32(1.0)}) is None
    assert group_key({"A": [1.0, 2.0]}) is None
