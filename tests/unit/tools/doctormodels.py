"""Tiny models for the doctor's tests, importable as ``doctormodels:NAME``."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
_WEIGHTS = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)


def per_item(batch: Array) -> Array:
    """Row-wise: each output depends only on its own input."""
    return np.tanh(batch @ _WEIGHTS)


def batch_mean(batch: Array) -> Array:
    """Subtracts the mean over the batch: a cross-sample reduction."""
    return (batch - batch.mean(axis=0, keepdims=True)) @ _WEIGHTS


def as_dict(batch: Array) -> dict[str, Array]:
    """Two outputs in a dict: one per-item, one summed over the item's features."""
    return {"proj": batch @ _WEIGHTS, "total": batch.sum(axis=1)}


def masked_sum(batch: Array) -> Array:
    """Sum over the variable axis 0 of (length, 4) items: padding with zeros changes nothing."""
    return batch.sum(axis=1)


def padded_mean(batch: Array) -> Array:
    """Mean over the variable axis, padded zeros included: depends on padding length."""
    return batch.mean(axis=1)


def make_per_item(device: str) -> Any:
    """A ``device`` factory returning :func:`per_item`."""
    assert device == "cpu"
    return per_item


def build_torch(norm: str, *, is_training: bool = False) -> Any:
    """Linear - norm - ReLU - Linear on 8 features; ``norm`` is ``batch`` or ``group``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = nn.BatchNorm1d(16) if norm == "batch" else nn.GroupNorm(4, 16)
    model = nn.Sequential(nn.Linear(8, 16), layer, nn.ReLU(), nn.Linear(16, 4))
    return model.train(is_training)


def build_per_item() -> Any:
    """A zero-argument factory returning :func:`per_item`."""
    return per_item


def build_group_norm() -> Any:
    """A zero-argument factory returning an ``nn.Module``: serve's torch ``module:factory``."""
    return build_torch("group")


def by_name(inputs: dict[str, Array]) -> dict[str, Array]:
    """A serve python model: ``{"x": batch}`` in, ``{"y": per_item(batch)}`` out."""
    return {"y": per_item(inputs["x"])}
