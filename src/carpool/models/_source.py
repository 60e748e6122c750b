"""Resolving ``module:attr`` references for the runners."""

from __future__ import annotations

import importlib
import re
from typing import Any

from carpool.errors import ConfigError

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
    saying why, so that ``carpool serve`` names the model's key instead of a traceback."""
    try:
        return factory(*args)
    except Exception as error:
        raise ConfigError(
            "source", source, f"a factory that builds the model ({type(error).__name__}: {error})"
        ) from error
