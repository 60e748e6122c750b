"""Imports run one way: ``cli`` → ``server``/``tools`` → ``models``/``generation`` → ``core``
→ ``errors``. This walks the source with ``ast`` (nothing is imported) and fails when the
direction breaks, naming the file, the line and the import, or when modules import each
other round a cycle, naming the modules.

Every import counts for both: at import time, inside ``if TYPE_CHECKING:`` and inside a
function. A lazy or type-only import defers when a module is loaded, not what it needs: a
cycle through one is still two modules that cannot be read or changed apart (the three
circles issue 23 cut were all of those).

Last, a subprocess builds and steps a generation engine and finds that it loaded nothing
above ``carpool.generation``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
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
        if _is_within(module, "carpool.server") and any(
            _is_within(imp.module, f"carpool.{up}") for up in ("tools", "cli")
        ):
            out.append(f"{where}: carpool.server sits below cli, beside tools")
    return out


# -- cycles ------------------------------------------------------------------------------------


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``{module: the modules of sources it imports}`` for ``{module: (source,
    is_package)}``, every import counted (see the module docstring). ``from p import
    name`` is an edge to ``p.name`` when that is a module, else to ``p``."""
    graph: dict[str, set[str]] = {module: set() for module in sources}
    for module, (source, is_package) in sources.items():
        tree = ast.parse(source)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                for base in _resolve(node, module, is_package):
                    names = [f"{base}.{alias.name}" for alias in node.names]
                    targets += [name if name in sources else base for name in names]
            graph[module] |= {t for t in targets if t in sources and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


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


def test_the_import_graph_has_no_cycles() -> None:
    sources = {
        _module_name(path): (path.read_text(encoding="utf-8"), _is_package(path))
        for path in _sources()
    }
    assert cycles(import_graph(sources)) == []


def test_building_and_stepping_an_engine_loads_nothing_above_generation() -> None:
    """The generation seam: ``carpool.generation`` builds and runs an engine on its own."""
    script = textwrap.dedent(
        """
        import asyncio
        import sys

        from carpool.generation.build import GenerationSettings, build_engine, resolve_settings
        from carpool.generation.tokenizer import ByteTokenizer
        from carpool.generation.types import SamplingParams
        from carpool.generation.weights import random_llama

        async def main() -> None:
            tokenizer = ByteTokenizer()
            config = {
                "model_type": "llama", "hidden_act": "silu", "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 64,
                "vocab_size": tokenizer.vocab_size,
            }
            model = random_llama(config, seed=0)
            settings = GenerationSettings(block_size=4, num_blocks=16, max_num_seqs=2)
            engine = build_engine("seam", model, tokenizer, resolve_settings(model, settings))
            await engine.start()
            sampling = SamplingParams(max_tokens=3, ignore_eos=True)
            events = [e async for e in engine.generate(tokenizer.encode("hi"), sampling)]
            await engine.stop()
            assert events[-1].finish_reason == "length", events

        asyncio.run(main())
        above = ("carpool.server", "carpool.tools", "carpool.cli")
        print(sorted(m for m in sys.modules if m.startswith(above)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


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


def test_detects_the_server_importing_tools() -> None:
    assert violations("from carpool.tools import bench\n", "carpool.server.app")
    assert violations("from carpool.core import Batcher\n", "carpool.server.app") == []


def _graph(**sources: str) -> dict[str, set[str]]:
    return import_graph(
        {name.replace("_", "."): (source, False) for name, source in sources.items()}
    )


@pytest.mark.parametrize(
    "b_source",
    [
        "import a\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import X\n",
        "def f():\n    from a import X\n",
    ],
)
def test_detects_a_cycle_through_any_kind_of_import(b_source: str) -> None:
    graph = _graph(a="from b import Y\n", b=b_source, c="import a\n")
    assert cycles(graph) == [["a", "b"]]


def test_detects_a_longer_cycle_and_leaves_a_chain_alone() -> None:
    assert cycles(_graph(a="import b\n", b="import c\n", c="import a\n")) == [["a", "b", "c"]]
    assert cycles(_graph(a="import b\n", b="import c\n", c="import os\n")) == []


def test_from_a_package_import_a_module_is_an_edge_to_that_module() -> None:
    sources = {
        "p": ("", True),
        "p.m": ("from p import n\n", False),
        "p.n": ("from p import m, CONSTANT\n", False),
    }
    assert import_graph(sources) == {"p": set(), "p.m": {"p.n"}, "p.n": {"p", "p.m"}}
