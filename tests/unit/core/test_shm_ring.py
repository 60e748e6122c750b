"""Payloads through a shared-memory region: arrays by header, the rest pickled."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from carpool.core.shm_ring import ALIGN_BYTES, INITIAL_REGION_BYTES, PayloadKind, Reader, Region


@pytest.fixture
def ends() -> Iterator[tuple[Region, Reader]]:
    region, reader = Region(), Reader()
    yield region, reader
    reader.close()
    region.close()


def test_an_array_and_a_dict_cross_as_views_named_by_a_header(ends: tuple[Region, Reader]) -> None:
    region, reader = ends
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    header = region.write(array)
    assert header.kind is PayloadKind.ARRAY and header.pickled is None
    view = reader.read(header, copy=False)
    np.testing.assert_array_equal(view, array)
    del view
    payload = {"a": np.ones((2, 3), np.float32), "b": np.array(["x", "yz"])}
    got = reader.read(region.write(payload), copy=True)
    assert got.keys() == payload.keys()
    for key in payload:
        np.testing.assert_array_equal(got[key], payload[key])
        assert got[key].dtype == payload[key].dtype


def test_a_payload_larger_than_the_region_grows_it(ends: tuple[Region, Reader]) -> None:
    region, reader = ends
    region.write(np.zeros(4))
    first = region.name
    big = np.linspace(0, 1, INITIAL_REGION_BYTES // 4)  # twice the first region
    np.testing.assert_array_equal(reader.read(region.write(big), copy=True), big)
    assert region.name != first


def test_cpu_torch_tensors_come_back_as_tensors(ends: tuple[Region, Reader]) -> None:
    torch = pytest.importorskip("torch")
    region, reader = ends
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    got = reader.read(region.write({"t": tensor}), copy=True)["t"]
    assert isinstance(got, torch.Tensor) and torch.equal(got, tensor)


def test_other_payloads_are_pickled_in_the_header(ends: tuple[Region, Reader]) -> None:
    region, reader = ends
    for payload in (["a", "b"], np.array([object()]), {"a": np.zeros(1), "b": [1]}):
        header = region.write(payload)
        assert header.kind is PayloadKind.PICKLED
        assert reader.read(header, copy=False) is payload


DTYPES = st.sampled_from(["<f4", "<f8", "<i8", "|u1", "|b1", "<U3", "<c8"])
ARRAYS = DTYPES.flatmap(
    lambda dtype: hnp.arrays(np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))
)


@given(st.dictionaries(st.text(min_size=1, max_size=4), ARRAYS, min_size=1, max_size=5))
@settings(max_examples=60, deadline=None)
def test_write_then_read_is_identity_and_slots_are_aligned_in_order(
    payload: dict[str, np.ndarray],
) -> None:
    region, reader = Region(), Reader()
    try:
        header = region.write(payload)
        offsets = [slot.offset_bytes for slot in header.slots]
        assert offsets == sorted(offsets) and all(o % ALIGN_BYTES == 0 for o in offsets)
        got = reader.read(header, copy=True)
        assert list(got) == list(payload)
        for key, array in payload.items():
            assert got[key].dtype == array.dtype and got[key].shape == array.shape
            np.testing.assert_array_equal(got[key], array)
    finally:
        reader.close()
        region.close()
