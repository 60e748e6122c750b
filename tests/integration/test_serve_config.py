"""`carpool serve CONFIG.yaml` on loopback: a Python and an ONNX model, via tritonclient."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from .conftest import free_port

START_TIMEOUT_S = 60.0
HERE = Path(__file__).resolve().parent
W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
B = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def _env() -> dict[str, str]:
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
    }


def _serve(config: Path, port: int) -> list[str]:
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config)]
    return [*command, "--port", str(port), *_grpc_args()]


def _grpc_args() -> list[str]:
    """``--grpc-port 0`` (no gRPC server) where this version of ``carpool serve`` has it."""
    help_text = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return ["--grpc-port", "0"] if "--grpc-port" in help_text else []


def _write_affine_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["Y"]),
        ],
        "affine",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


CONFIG = """\
models:
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 16
    max_delay_s: 0.001
  - name: affine
    kind: onnx
    source: affine.onnx
    version: 2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("serve_config")
    _write_affine_onnx(folder / "affine.onnx")
    (folder / "serve.yaml").write_text(CONFIG, encoding="utf-8")
    port = free_port()
    process = subprocess.Popen(
        _serve(folder / "serve.yaml", port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=str(folder.parent),  # the onnx path resolves against the config's folder
    )
    url = f"127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"http://{url}/v2/health/ready", timeout=1.0).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            out = process.communicate()[0].decode()
            pytest.fail(f"carpool serve did not become ready:\n{out}")
        time.sleep(0.1)  # polling a subprocess's readiness, not a timing assertion
    yield url
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    if process.stdout is not None:
        process.stdout.close()


@pytest.fixture
def client(server: str) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server)
    yield client
    client.close()


def test_serves_the_python_model_from_the_config(
    client: httpclient.InferenceServerClient,
) -> None:
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    infer_input = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    infer_input.set_data_from_numpy(x)
    result = client.infer("doubler", [infer_input])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)


def test_serves_the_onnx_model_with_specs_read_from_the_file(
    client: httpclient.InferenceServerClient,
) -> None:
    metadata = client.get_model_metadata("affine")
    assert metadata["versions"] == ["2"]
    assert metadata["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}]
    assert metadata["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [-1, 3]}]
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    infer_input = httpclient.InferInput("X", list(x.shape), "FP32")
    infer_input.set_data_from_numpy(x)
    result = client.infer("affine", [infer_input], model_version="2")
    np.testing.assert_allclose(result.as_numpy("Y"), x @ W + B, rtol=1e-6)


def test_broken_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            models:
              - name: doubler
                kind: python
                source: configmodels:double
                inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
                outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
                max_dealy_s: 0.002
            """
        ),
        encoding="utf-8",
    )
    done = subprocess.run(
        _serve(path, free_port()),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 2
    assert f"{path}: invalid models[0].max_dealy_s" in done.stderr
    assert "did you mean 'max_delay_s'" in done.stderr
    assert "Traceback" not in done.stderr
