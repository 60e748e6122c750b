"""Python models that the integration tests serve from a config file."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np


def double(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """A batched callable: ``OUTPUT0 = 2 * INPUT0``."""
    return {"OUTPUT0": inputs["INPUT0"] * 2}


def identity(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Every ``IN_<x>`` comes back as ``OUT_<x>``, unchanged."""
    return {"OUT_" + name.removeprefix("IN_"): value for name, value in inputs.items()}


def slow_double(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """``OUTPUT0 = 2 * INPUT0``, sleeping 20 ms per batch so requests pile up in flight."""
    time.sleep(0.02)
    return {"OUTPUT0": inputs["INPUT0"] * 2}


GATE_WAIT_LIMIT_S = 30.0


def gated(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """``Y = X``. Appends every value it sees to the file ``$CARPOOL_TEST_SEEN``, then
    blocks while the file ``$CARPOOL_TEST_GATE`` exists (at most 30 s)."""
    x = inputs["X"]
    with open(os.environ["CARPOOL_TEST_SEEN"], "a", encoding="utf-8") as seen:
        seen.writelines(f"{int(v)}\n" for v in x.ravel())
    gate = os.environ["CARPOOL_TEST_GATE"]
    limit = time.monotonic() + GATE_WAIT_LIMIT_S
    while os.path.exists(gate) and time.monotonic() < limit:
        time.sleep(0.005)
    return {"Y": x}


def ragged_sum(inputs: dict[str, Any]) -> dict[str, Any]:
    """``TOKENS`` is ragged (arrives packed): ``SUM`` = each row's sum x ``SCALE``, ``DOUBLED``
    = every token x 2 (per-token, so returned packed). Slow (20 ms) so requests share batches.
    Refuses a padded batch, so a test fails if padding ever reaches it."""
    from carpool.core.layout import Packed

    tokens = inputs["TOKENS"]
    if not isinstance(tokens, Packed):
        raise TypeError(f"expected TOKENS packed, got {type(tokens).__name__}")
    time.sleep(0.02)
    sums = np.add.reduceat(tokens.data, tokens.offsets) if tokens.num_tokens else tokens.data
    return {
        "SUM": sums * inputs["SCALE"][:, 0],
        "DOUBLED": Packed.from_lengths(tokens.data * 2, tokens.lengths),
        "LONGEST": np.full(tokens.num_items, tokens.max_length, dtype=np.int32),
    }


HANG_S = 120.0  # "for ever" for a test: far longer than any test waits


def hangs_on_negative(device: str) -> Any:
    """A factory (one model per replica): ``OUTPUT0 = 2 * INPUT0``, except that a batch
    holding a negative value hangs (sleeps HANG_S). Every build after the first waits
    while the file ``$CARPOOL_TEST_GATE`` exists (at most 30 s), so that a test sees the
    replica being rebuilt after a hang."""
    marker = os.environ["CARPOOL_TEST_GATE"] + ".built"
    if os.path.exists(marker):
        limit = time.monotonic() + GATE_WAIT_LIMIT_S
        while os.path.exists(os.environ["CARPOOL_TEST_GATE"]) and time.monotonic() < limit:
            time.sleep(0.005)
    with open(marker, "a", encoding="utf-8") as built:
        built.write(f"{device}\n")

    def model(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        x = inputs["INPUT0"]
        if (x < 0).any():
            time.sleep(HANG_S)
        return {"OUTPUT0": x * 2}

    return model


LEAK_BYTES = 256 * 1024
_LEAKED: list[bytes] = []


def leaky(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """``OUTPUT0 = 2 * INPUT0``, keeping LEAK_BYTES (written, so resident) per call forever:
    a model that leaks."""
    _LEAKED.append(b"\x01" * LEAK_BYTES)
    return {"OUTPUT0": inputs["INPUT0"] * 2}


async def server_probe(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """The server's asyncio tasks, threads and open descriptors, one row per input row."""
    row = [len(asyncio.all_tasks()), threading.active_count(), len(os.listdir("/proc/self/fd"))]
    return {"N": np.array([row] * len(inputs["X"]), dtype=np.int64)}
