"""Resolving ``module:attr`` references for the runners."""

from __future__ import annotations

import importlib
import re
import threading
from typing import Any

from carpool.errors import ConfigError

# Replicas, of one model and of all the models a config lists, build their copies on their
# own threads at once, so builds take turns. A factory that seeds torch's global RNG
# (torch.manual_seed, then nn.Linear's initialisation) would otherwise interleave its draws
# with another one's and build other weights than its seed gives; and torch.export.load keeps
# its deserializer in a module global, refusing a second concurrent load
# ("_CURRENT_DESERIALIZER is already set"). Loading replicas one at a time costs start-up
# time on several GPUs, never serving time.
BUILD_LOCK = threading.RLock()

_IMPORT_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_import_ref(source: str) -> bool:
    """Whether ``source`` reads as ``module:attr`` rather than a file path."""
    return _IMPORT_REF.fullmatch(source) is not None


def import_ref(source: str) -> Any:
    """The object ``module:attr`` names (``attr`` may be dotted).

    Raises:
        ConfigError: on field ``source`` when the module cannot be imported or lacks the name.
    """
    module_name, sep, attr = source.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("source", source, "module:attr")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as error:  # an import runs user code: any error is a config error here
        raise ConfigError(
            "source", source, f"an importable module ({type(error).__name__}: {error})"
        ) from error
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                "source", source, f"a name {attr!r} defined in module {module_name!r}"
            ) from None
    return obj


def build_with(source: str, factory: Any, *args: Any) -> Any:
    """``factory(*args)``, the model's own code: a failure is a ConfigError on ``source``
    saying why, so that ``carpool serve`` names the model's key instead of a traceback.
    Factories run one at a time (``BUILD_LOCK``)."""
    try:
        with BUILD_LOCK:
            return factory(*args)
    except Exception as error:
        raise ConfigError(
            "source", source, f"a factory that builds the model ({type(error).__name__}: {error})"
        ) from error
