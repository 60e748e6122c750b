"""The packed layout: pack/unpack identity, offsets, padding, buckets (NumPy and torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.layout import LengthBuckets, Packed, padding_waste
from carpool.errors import ConfigError, InvalidInput

lengths_st = st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=10)


def _items(lengths: list[int], width: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(len(lengths))
    return [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]


@given(lengths_st)
@settings(max_examples=200, deadline=None)
def test_pack_then_unpack_is_identity_for_any_lengths(lengths: list[int]) -> None:
    items = _items(lengths)
    packed = Packed.from_items(items)
    assert [a.shape for a in packed.items()] == [a.shape for a in items]
    for got, want in zip(packed.items(), items, strict=True):
        np.testing.assert_array_equal(got, want)


@given(lengths_st)
@settings(max_examples=200, deadline=None)
def test_offsets_increase_and_end_at_the_total(lengths: list[int]) -> None:
    packed = Packed.from_items(_items(lengths))
    offsets = packed.offsets.tolist()
    assert offsets == sorted(offsets)
    assert offsets[0] == 0
    assert offsets[-1] + lengths[-1] == sum(lengths) == packed.num_tokens
    cu = packed.cu_seqlens
    assert cu.dtype == np.int32
    assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert packed.segment_ids.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]


@given(lengths_st, st.sampled_from([None, 1, 4, 8]))
@settings(max_examples=150, deadline=None)
def test_padded_round_trip_keeps_every_item(lengths: list[int], multiple_of: int | None) -> None:
    packed = Packed.from_items(_items(lengths))
    dense, mask = packed.to_padded(pad_value=-1.0, multiple_of=multiple_of)
    assert dense.shape[0] == len(lengths)
    assert dense.shape[1] == packed.padded_length(multiple_of)
    if multiple_of:
        assert dense.shape[1] % multiple_of == 0
    assert mask.sum(axis=1).tolist() == lengths
    assert (dense[~mask] == -1.0).all()
    back = Packed.from_padded(dense, packed.lengths)
    np.testing.assert_array_equal(back.data, packed.data)
    np.testing.assert_array_equal(back.lengths, packed.lengths)


@given(lengths_st)
@settings(max_examples=100, deadline=None)
def test_torch_and_numpy_agree(lengths: list[int]) -> None:
    items = _items(lengths)
    packed_np = Packed.from_items(items)
    packed_t = Packed.from_items([torch.from_numpy(a) for a in items])
    assert packed_t.cu_seqlens.dtype == torch.int32
    assert packed_t.cu_seqlens.tolist() == packed_np.cu_seqlens.tolist()
    assert packed_t.segment_ids.tolist() == packed_np.segment_ids.tolist()
    dense_t, mask_t = packed_t.to_padded(multiple_of=4)
    dense_np, mask_np = packed_np.to_padded(multiple_of=4)
    np.testing.assert_array_equal(dense_t.numpy(), dense_np)
    np.testing.assert_array_equal(mask_t.numpy(), mask_np)
    back = Packed.from_padded(dense_t, packed_t.lengths)
    assert torch.equal(back.data, packed_t.data)


def test_items_are_views_not_copies() -> None:
    packed = Packed.from_items(_items([2, 3]))
    first = packed.items()[0]
    assert np.shares_memory(first, packed.data)
    one = np.zeros((4, 2), dtype=np.float32)
    assert Packed.from_items([one]).data is one  # a single item is not copied


def test_split_tokens_and_rows_cut_outputs_per_item() -> None:
    packed = Packed.from_items(_items([2, 0, 3]))
    per_token = np.arange(5)
    assert [p.tolist() for p in packed.split_tokens(per_token)] == [[0, 1], [], [2, 3, 4]]
    per_item = np.arange(6).reshape(3, 2)
    assert [r.tolist() for r in packed.split_rows(per_item)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InvalidInput, match="4 rows; the packed batch has 5 tokens"):
        packed.split_tokens(np.arange(4))
    with pytest.raises(InvalidInput, match="2 rows; the packed batch has 3 items"):
        packed.split_rows(np.arange(2))


def test_bad_items_and_lengths_are_named() -> None:
    with pytest.raises(InvalidInput, match="0 items"):
        Packed.from_items([])
    with pytest.raises(InvalidInput, match="equal trailing shapes"):
        Packed.from_items([np.zeros((2, 3)), np.zeros((2, 4))])
    with pytest.raises(InvalidInput, match="lengths add up to 4, but data has 5 rows"):
        Packed.from_lengths(np.zeros(5), [1, 3])
    with pytest.raises(InvalidInput, match="counts >= 0"):
        Packed.from_lengths(np.zeros(2), [3, -1])
    with pytest.raises(ConfigError, match="multiple_of"):
        Packed.from_items(_items([1])).to_padded(multiple_of=0)


def test_padding_waste_counts_padded_slots_over_all_slots() -> None:
    # "hello", "worldwide", "AI" padded to 9: 27 slots, 16 real.
    assert padding_waste([5, 9, 2]) == pytest.approx(11 / 27)
    assert padding_waste([4, 4]) == 0.0
    assert padding_waste([3, 4], multiple_of=8) == pytest.approx(1 - 7 / 16)
    assert padding_waste([]) == 0.0


def test_explicit_buckets_use_inclusive_upper_edges() -> None:
    buckets = LengthBuckets([32, 128])
    assert [buckets.bucket_of(n) for n in (1, 32, 33, 128, 129, 5000)] == [0, 0, 1, 1, 2, 2]


def test_auto_buckets_follow_observed_lengths() -> None:
    buckets = LengthBuckets("auto", num_buckets=2, window=8)
    assert buckets.edges == ()
    for n in [10, 10, 10, 10, 200, 200, 200, 200]:
        buckets.bucket_of(n)
    assert buckets.edges == (10,)  # the lower half ends at 10
    assert buckets.bucket_of(9) == 0
    assert buckets.bucket_of(500) == 1


@pytest.mark.parametrize(
    ("edges", "kwargs"),
    [("sometimes", {}), ([], {}), ([8, 8], {}), ([16, 4], {}), ([-1], {}), ("auto", {"window": 2})],
)
def test_bad_bucket_settings_raise_config_error(edges: object, kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        LengthBuckets(edges, **kwargs)  # type: ignore[arg-type]
