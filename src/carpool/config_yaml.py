"""YAML read strictly, for :mod:`carpool.config`: a key given twice in one mapping is an
error (PyYAML keeps the last one), ``1e-3`` is a number as in YAML 1.2, and a syntax
error is a :class:`~carpool.errors.ConfigError` naming its line, column and text."""

from __future__ import annotations

import re
from typing import Any

import yaml  # type: ignore[import-untyped]

from carpool.errors import ConfigError


def load_yaml(text: str, file: str) -> Any:
    """``text`` parsed (None for an empty document).

    Raises:
        ConfigError: naming ``file``, where the YAML is wrong and what is wrong there.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as error:
        raise _yaml_error(error, file) from None


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the
    last: ``max_batch_size: 8`` then ``64`` would silently be 64)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor`: its keys are merged below, the mapping's own win
        key = loader.construct_object(key_node)
        try:
            is_twice = key in seen
        except TypeError:  # a list or mapping as a key (`? [x, y]`)
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, found {key!r}", key_node.start_mark
            ) from None
        if is_twice:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)
# YAML 1.2 reads 1e-3 and 2E5 as numbers; PyYAML (YAML 1.1, which needs a dot: 1.0e-3)
# reads them as strings, and `max_delay_s: 1e-3` would be refused as "not a number".
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_error(error: yaml.YAMLError, file: str) -> ConfigError:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "YAML"
    snippet = ""
    if mark is not None and mark.buffer is not None:
        lines = str(mark.buffer).rstrip("\0").splitlines()
        snippet = lines[mark.line].strip() if mark.line < len(lines) else ""
    return ConfigError(where, snippet, f"valid YAML ({problem})", file=file)
