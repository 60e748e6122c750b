"""`carpool serve CONFIG.yaml` with torch models built here, as a Triton user writes the
config, found in review against Triton's PyTorch backend. Each test failed before its fix.

Every failing case is a startup that must end with exit status 2 and one line naming the
file, the model's key and the reason, before any request: the server is a subprocess, so
what torch itself logs to stderr counts too. And a forward a decorator wraps is served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

RUN_LIMIT_S = 120.0  # a net against a hung start, not a timing assertion

MODELS = """
import torch
from torch import nn


class Affine(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x)


class Pair(nn.Module):
    def forward(self, x, ids):
        return x * 2, ids + 1


def affine():
    return Affine()


def pair():
    return Pair()
"""

IO = """\
    inputs: [{name: x, datatype: FP32, shape: [4]}]
    outputs: [{name: y, datatype: FP32, shape: [3]}]
"""


@pytest.fixture
def folder(built: Path, tmp_path: Path) -> Path:
    """A folder of this test's own with ``rrmodels.py`` and the same model saved as
    TorchScript (affine.pt), a torch.export program (affine.pt2) and a torch.save
    checkpoint (weights.pt): copies of what ``built`` exported once."""
    target = tmp_path / "models"
    shutil.copytree(built, target)
    return target


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("runner-review")
    (tmp_path / "rrmodels.py").write_text(MODELS, encoding="utf-8")
    script = textwrap.dedent(
        """
        import sys
        import torch
        sys.path.insert(0, ".")
        import rrmodels

        model = rrmodels.affine().eval()
        torch.jit.save(torch.jit.script(model), "affine.pt")
        batch = torch.export.Dim("batch")
        program = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes={"x": {0: batch}})
        torch.export.save(program, "affine.pt2")
        torch.save(model.state_dict(), "weights.pt")
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=RUN_LIMIT_S)
    return tmp_path


def _serve_fails(folder: Path, entry: str) -> str:
    """Serve one model entry (YAML lines after ``- name: m``); the single line it fails
    with, after checking the exit status and that nothing else was printed."""
    config = folder / "serve.yaml"
    config.write_text(f"models:\n  - name: m\n{entry}", encoding="utf-8")
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config)]
    command += ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0"]
    result = subprocess.run(
        command,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, output
    assert len(output.splitlines()) == 1, output
    assert output.startswith(f"carpool serve: {config}: invalid models[0]."), output
    return output


def test_a_corrupt_pt2_file_fails_in_one_line_with_the_first_reason(folder: Path) -> None:
    # torch.export.load logged its first error with a 12-line traceback, then raised the
    # error of a fallback reader ("BadZipFile: File is not a zip file").
    (folder / "broken.pt2").write_bytes(b"not a zip archive")
    line = _serve_fails(folder, f"    kind: torch\n    source: broken.pt2\n{IO}")
    assert "models[0].source=" in line and "broken.pt2" in line
    assert "not a ZIP archive" in line and "BadZipFile" not in line


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("weights.pt", "it is a torch.save checkpoint"),
        ("model.pt2", "it is a TorchScript file: name it .pt"),
        ("program.pt", "it is a torch.export program: name it .pt2"),
    ],
)
def test_a_torch_file_of_another_kind_says_what_it_is(
    folder: Path, source: str, reason: str
) -> None:
    # torch's own message blamed a corrupt file ("failed locating file constants.pkl ...
    # your checkpoint file is corrupted") for a file that is only of another kind.
    (folder / "model.pt2").write_bytes((folder / "affine.pt").read_bytes())
    (folder / "program.pt").write_bytes((folder / "affine.pt2").read_bytes())
    line = _serve_fails(folder, f"    kind: torch\n    source: {source}\n{IO}")
    assert f"models[0].source='{folder / source}'" in line and reason in line, line
    assert "corrupted" not in line


@pytest.mark.parametrize("source", ["rrmodels:pair", "affine.pt", "affine.pt2"])
def test_declared_inputs_the_forward_does_not_take_fail_at_startup(
    folder: Path, source: str
) -> None:
    # Triton's PyTorch backend refuses the load ("configuration expects 1 inputs, model
    # provides 2"); carpool served the model and failed every request with a 500.
    entry = f"    kind: torch\n    source: {source}\n"
    if source == "rrmodels:pair":  # forward(x, ids), one input declared
        line = _serve_fails(folder, entry + IO)
        assert "models[0].inputs=['x']" in line and "forward takes (x, ids)" in line
    else:  # forward(x), two inputs declared
        two = IO.replace("shape: [4]}]", "shape: [4]}, {name: z, datatype: FP32, shape: [4]}]")
        line = _serve_fails(folder, entry + two)
        assert "models[0].inputs=['x', 'z']" in line and "forward takes (x)" in line


@pytest.mark.parametrize(
    ("kind", "source", "expected"),
    [
        ("torch", "affine.pt:forward", "the model file's path alone, affine.pt"),
        ("python", "rrmodels.py:affine", "module:attr, the module's name: rrmodels:affine"),
    ],
)
def test_a_file_written_as_module_attr_is_named_as_the_file_it_is(
    folder: Path, kind: str, source: str, expected: str
) -> None:
    # Read as module:attr, it failed as "No module named 'affine'".
    line = _serve_fails(folder, f"    kind: {kind}\n    source: {source}\n{IO}")
    assert f"models[0].source='{source}'" in line and expected in line, line


def test_max_batch_size_0_says_what_carpool_takes_for_tritons_no_batching(
    folder: Path,
) -> None:
    # "expected greater than or equal to 1" left a Triton user's max_batch_size: 0 (a model
    # without a batch dimension) unexplained.
    entry = f"    kind: torch\n    source: rrmodels:affine\n    max_batch_size: 0\n{IO}"
    line = _serve_fails(folder, entry)
    assert "models[0].max_batch_size=0" in line
    assert "for Triton's 0 (no batching) give 1" in line


# A forward decorated with functools.wraps by a decorator that supplies an argument
# itself: the call reaches the wrapper, which takes x alone.
DECORATED = """
import functools

import torch
from torch import nn


def with_bias(forward):
    @functools.wraps(forward)
    def wrapper(self, x):
        return forward(self, x, torch.ones_like(x))

    return wrapper


class Biased(nn.Module):
    @with_bias
    def forward(self, x, bias):
        return x + bias


def biased():
    return Biased()
"""


def test_torch_forward_decorated_to_supply_an_argument_is_served(
    start_server: Any, tmp_path: Path
) -> None:
    # The load check read the wrapped function's (x, bias) through __wrapped__ and refused
    # the one declared input: `carpool serve` exited 2 for a model that runs as declared.
    config = textwrap.dedent("""\
        models:
          - name: biased
            kind: torch
            source: afternoon_models:biased
            inputs: [{name: x, datatype: FP32, shape: [3]}]
            outputs: [{name: y, datatype: FP32, shape: [3]}]
        """)
    models = tmp_path / "models"
    models.mkdir()
    (models / "afternoon_models.py").write_text(DECORATED, encoding="utf-8")
    served = start_server(config, env={"PYTHONPATH": str(models)})
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        tensor = httpclient.InferInput("x", [2, 3], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("biased", [tensor])
        np.testing.assert_array_equal(result.as_numpy("y"), x + 1)
    finally:
        client.close()
