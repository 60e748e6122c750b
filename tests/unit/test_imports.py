"""Imports run one way: ``cli`` → ``server``/``tools`` → ``models``/``generation`` → ``core``
→ ``errors``. This walks the source with ``ast`` (nothing is imported) and fails when the
direction breaks, naming the file, the line and the import.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "carpool"

# The packages above core; core may import none of them.
ABOVE_CORE = ("models", "generation", "server", "tools", "config", "cli")
# Third-party imports core may run at import time: "pure Python + NumPy".
CORE_THIRD_PARTY = {"numpy"}


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    lineno: int
    is_module_level: bool  # runs when the module is imported
    is_type_checking: bool  # inside ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if node.level == 0:
        assert node.module is not None
        return [node.module]
    base_parts = module.split(".")
    if not is_package:
        base_parts = base_parts[:-1]
    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
    base = ".".join(base_parts)
    if node.module is not None:
        return [f"{base}.{node.module}"]
    return [f"{base}.{alias.name}" for alias in node.names]


def _is_type_checking_test(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "TYPE_CHECKING") or (
        isinstance(node, ast.Attribute) and node.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str, *, is_package: bool = False) -> list[Import]:
    """Every import in ``source``, absolute, with where it runs."""
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, module_level, type_checking))
        elif isinstance(node, ast.ImportFrom):
            for name in _resolve(node, module, is_package):
                found.append(Import(name, node.lineno, module_level, type_checking))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(arg.value, node.lineno, module_level, type_checking))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            module_level = False
        if isinstance(node, ast.If) and _is_type_checking_test(node.test):
            for child in node.body:
                visit(child, module_level, True)
            for child in node.orelse:
                visit(child, module_level, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, module_level, type_checking)

    visit(ast.parse(source), True, False)
    return found


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in {"import_module", "__import__"} and bool(node.args)


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The import-direction rules broken by ``source`` (the module ``module``)."""
    out: list[str] = []
    for imp in imports_of(source, module, is_package=is_package):
        where = f"{module}:{imp.lineno} imports {imp.module}"
        top = imp.module.split(".")[0]
        if _is_within(module, "carpool.errors") and top == "carpool":
            out.append(f"{where}: carpool.errors imports nothing from carpool")
        if _is_within(module, "carpool.core"):
            if top == "carpool" and not (
                _is_within(imp.module, "carpool.core") or imp.module == "carpool.errors"
            ):
                out.append(f"{where}: carpool.core imports only carpool.core and carpool.errors")
            if (
                top != "carpool"
                and imp.is_module_level
                and not imp.is_type_checking
                and top not in sys.stdlib_module_names
                and top not in CORE_THIRD_PARTY
            ):
                out.append(f"{where} at import time: core runs on the stdlib and NumPy only")
        for low in ("carpool.models", "carpool.generation"):
            if _is_within(module, low) and any(
                _is_within(imp.module, f"carpool.{up}") for up in ("server", "tools", "cli")
            ):
                out.append(f"{where}: {low} sits below server, tools and cli")
    return out


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_walks_the_real_source_tree() -> None:
    names = {_module_name(p) for p in _sources()}
    assert {"carpool", "carpool.errors", "carpool.core.batcher", "carpool.core.scheduler"} <= names


@pytest.mark.parametrize("path", _sources(), ids=lambda p: _module_name(p))
def test_module_keeps_the_import_direction(path: Path) -> None:
    broken = violations(
        path.read_text(encoding="utf-8"), _module_name(path), is_package=_is_package(path)
    )
    assert broken == []


# -- the checker itself can fail -------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "import carpool.server\n",
        "from carpool.models import mlp\n",
        "from carpool import cli\n",
        "from ..tools import bench\n",
        "from .. import generation\n",
        "from carpool.config import Config\n",
        "import importlib\nimportlib.import_module('carpool.server.app')\n",
        "def f():\n    from carpool.server import app\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from carpool.server import x\n",
    ],
)
def test_detects_core_importing_upwards(source: str) -> None:
    assert violations(source, "carpool.core.batcher")


@pytest.mark.parametrize(
    "source",
    [
        "import torch\n",
        "from torch import nn\n",
        "try:\n    import torch\nexcept ImportError:\n    torch = None\n",
        "class A:\n    import torch\n",
        "import httpx\n",
    ],
)
def test_detects_core_importing_third_party_at_import_time(source: str) -> None:
    assert violations(source, "carpool.core.collate")


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    import torch\n",
        "async def f():\n    import torch\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "import numpy as np\nimport asyncio\nfrom collections import deque\n",
        "from carpool.errors import ConfigError\nfrom carpool.core.policy import BatchPolicy\n",
        "from .policy import BatchPolicy\nfrom ..errors import ConfigError\n",
    ],
)
def test_allows_what_core_may_import(source: str) -> None:
    assert violations(source, "carpool.core.collate") == []


def test_relative_import_in_core_package_init_resolves_within_core() -> None:
    assert violations("from .batcher import Batcher\n", "carpool.core", is_package=True) == []
    assert violations("from .. import server\n", "carpool.core", is_package=True)


def test_detects_errors_importing_from_carpool() -> None:
    assert violations("from carpool.core.policy import BatchPolicy\n", "carpool.errors")
    assert violations("from . import core\n", "carpool.errors")
    assert violations("import enum\n", "carpool.errors") == []


def test_detects_models_importing_the_server() -> None:
    assert violations("from carpool.server import app\n", "carpool.models.mlp")
    assert violations("from carpool.core import Batcher\n", "carpool.models.mlp") == []
