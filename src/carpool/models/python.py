"""Plain Python models: ``module:attr`` naming a batched callable or a factory of one.

The rule: ``attr`` is a **factory** when it is callable with exactly one parameter and that
parameter is named ``device``; it is then called once per replica with the replica's device
string (``"cpu"``, ``"cuda:0"``) and must return the batched callable. Anything else callable
is the **batched callable** itself, shared by every replica.

The batched callable takes ``{input name: array}`` with the batch along axis 0 and returns
``{output name: array}`` aligned with it; it may be ``async``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from carpool.errors import ConfigError
from carpool.models._source import build_with, import_ref

BatchFn = Callable[[Any], Any]
FnFactory = Callable[[str], BatchFn]


def is_factory(obj: Any) -> bool:
    """Whether ``obj`` takes exactly one parameter, named ``device`` (see the module doc)."""
    try:
        parameters = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return len(parameters) == 1 and parameters[0].name == "device"


def load_python(source: str) -> FnFactory:
    """A per-replica factory for the Python model ``source`` (``module:attr``).

    Raises:
        ConfigError: on field ``source`` when it cannot be imported or is not callable.
    """
    obj = import_ref(source)
    if not callable(obj):
        raise ConfigError(
            "source", source, f"a callable or a factory taking device, not {type(obj).__name__}"
        )
    if is_factory(obj):
        factory: FnFactory = obj

        def make(device: str) -> BatchFn:
            built: BatchFn = build_with(source, factory, device)
            return built

        return make

    fn: BatchFn = obj

    def shared(device: str) -> BatchFn:
        return fn

    return shared
