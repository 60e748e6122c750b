"""`carpool serve` as a Triton/vLLM user runs it: its config file, its ports and its
start-up. Each test was a bug a person would hit (a message in pydantic's words, a config
the CLI refused or accepted wrongly, a module beside the config that did not import, a
taken port found only after the models loaded or told in a traceback, a second server
taking the first one's ports, an out-of-range port, a signal while loading ending by the
signal) and failed before its fix. Every process binds 127.0.0.1 (or ::1), is bounded in
time, and is stopped here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import free_port, wait_until
from .test_serve_config import CONFIG as SERVE_CONFIG

RUN_LIMIT_S = 60.0  # a net against a hung process, never a timing assertion
CARPOOL = Path(sys.executable).parent / "carpool"  # the console script users run

# A python model whose replica factory, written beside the config, says it started
# loading (the file $CARPOOL_TEST_LOADING) and then loads while $CARPOOL_TEST_GATE exists.
GATED_LOADER = """\
import os, time


def factory(device):
    open(os.environ["CARPOOL_TEST_LOADING"], "w").close()
    limit = time.monotonic() + 30
    while os.path.exists(os.environ["CARPOOL_TEST_GATE"]) and time.monotonic() < limit:
        time.sleep(0.01)
    return lambda inputs: {"Y": inputs["X"]}
"""
# The same wait at import time: building the models (before the ports are bound for
# good) imports a python model's module, as it loads a generation or embeddings model's
# weights.
GATED_IMPORT = """\
import os, time

open(os.environ["CARPOOL_TEST_LOADING"], "w").close()
_limit = time.monotonic() + 30
while os.path.exists(os.environ["CARPOOL_TEST_GATE"]) and time.monotonic() < _limit:
    time.sleep(0.01)


def fn(inputs):
    return {"Y": inputs["X"]}
"""
GATED_CONFIG = """\
models:
  - name: m
    kind: python
    source: SOURCE
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
"""
MODEL = """\
models:
  - name: m
    kind: python
    source: numpy:negative
    inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
"""


class Gated:
    """A folder with the gated-loading model and its config; ``loading`` appears once a
    replica starts loading (``at="replica"``) or the models are built (``at="build"``),
    which goes on while ``gate`` exists."""

    def __init__(self, folder: Path, at: str = "replica") -> None:
        self.folder = folder
        self.config = folder / "serve.yaml"
        self.loading = folder / "loading"
        self.gate = folder / "gate"
        (folder / "gatedloader.py").write_text(GATED_LOADER)
        (folder / "gatedimport.py").write_text(GATED_IMPORT)
        source = {"replica": "gatedloader:factory", "build": "gatedimport:fn"}[at]
        self.config.write_text(GATED_CONFIG.replace("SOURCE", source))
        self.gate.touch()
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CARPOOL_TEST_LOADING": str(self.loading),
            "CARPOOL_TEST_GATE": str(self.gate),
            # (not what the import-beside-the-config test checks)
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(folder), os.environ.get("PYTHONPATH")) if p
            ),
        }


@pytest.fixture(params=["replica", "build"])
def gated(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Gated]:
    # A taken port and a signal were handled while the replicas loaded, but not while a
    # config's models were built (a generation or embeddings model's weights load then).
    folder = tmp_path / "gated"
    folder.mkdir()
    yield Gated(folder, request.param)
    folder.joinpath("gate").unlink(missing_ok=True)


def _serve(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``carpool serve ARGS`` run to its end (it must end by itself)."""
    return subprocess.run(
        [str(CARPOOL), "serve", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=RUN_LIMIT_S,
    )


def _start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(CARPOOL), "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
    )


def _finish(process: subprocess.Popen[str], signum: int | None = signal.SIGTERM) -> str:
    """Signal ``process`` (unless None), wait for its end; its output."""
    if signum is not None and process.poll() is None:
        process.send_signal(signum)
    try:
        out, _ = process.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        pytest.fail(f"carpool serve did not exit:\n{out}")
    return out


def _is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("carpool serve: ")]
    assert len(ours) == 1, done.stderr
    return ours[0]


# -- the config file ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says", "not_said"),
    [
        ("# nothing yet\n", "the file is empty", "ServeConfig"),
        ("models:\n  - doubler\n", "models[0]='doubler': expected a mapping", "ModelConfig"),
        (
            MODEL.replace("name: m", "name: my/model"),
            "models[0].name='my/model': expected a name that can appear in a URL path",
            "^[A-Za-z0-9]",
        ),
        (MODEL + "    version: v1/beta\n", "models[0].version='v1/beta'", "match pattern"),
        (MODEL + "    version: ''\n", "models[0].version=''", "match pattern"),
        (
            MODEL.replace("shape: [4]}]\n    outputs", "shape: [0]}]\n    outputs"),
            "models[0].inputs[0].shape=[0]: expected dimensions >= 1, or -1",
            "ready",
        ),
        (
            MODEL + "    length_buckets: some\n",
            "models[0].length_buckets='some': expected a valid list or 'auto'",
            "list[int]",
        ),
        (
            MODEL + "    devices: []\n",
            "models[0].devices=[]: expected a list of at least 1 item",
            "after validation",
        ),
    ],
    ids=["empty", "entry", "name", "version", "empty-version", "dim-0", "union", "too-short"],
)
def test_config_errors_say_what_was_expected_in_the_configs_words(
    tmp_path: Path, text: str, says: str, not_said: str
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    done = _serve(str(config), "--port", "0", "--grpc-port", "0", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = _one_line_error(done)
    assert line.startswith(f"carpool serve: {config}: invalid ")
    assert says in line and not_said not in line, line


def test_exponent_numbers_read_as_numbers(tmp_path: Path) -> None:
    # PyYAML (YAML 1.1) reads 1e-3 as the string '1e-3': "expected a valid number".
    config = tmp_path / "serve.yaml"
    config.write_text(MODEL + "    max_delay_s: 1e-3\n")
    port = free_port()
    process = _start(str(config), "--port", str(port), "--grpc-port", "0", cwd=tmp_path)
    try:
        wait_until(
            lambda: process.poll() is not None or _is_ready(f"http://127.0.0.1:{port}"),
            "the server to be ready or to exit",
        )
        assert process.poll() is None, _finish(process, None)
        answer = httpx.get(f"http://127.0.0.1:{port}/v2/models/m/config", timeout=5).json()
        assert answer["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    finally:
        out = _finish(process)
    assert process.returncode == 0, out


def test_max_batch_size_in_exponent_form_is_refused_as_a_float(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(MODEL + "    max_batch_size: 1e3\n")
    done = _serve(str(config), "--port", "0", "--grpc-port", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert "models[0].max_batch_size=1000.0: expected a valid integer" in _one_line_error(done)


def test_a_module_beside_the_config_imports_with_the_carpool_script(tmp_path: Path) -> None:
    # `carpool serve` (the console script) put neither the config's folder nor the working
    # directory on sys.path: `source: mymodel:fn` failed there, and worked with python -m.
    project = tmp_path / "project"
    project.mkdir()
    (project / "beside.py").write_text("def fn(inputs):\n    return {'Y': inputs['X']}\n")
    (project / "serve.yaml").write_text(GATED_CONFIG.replace("SOURCE", "beside:fn"))
    port = free_port()
    args = ("project/serve.yaml", "--port", str(port), "--grpc-port", "0")
    process = _start(*args, cwd=tmp_path)  # run from the folder above
    try:
        wait_until(
            lambda: process.poll() is not None or _is_ready(f"http://127.0.0.1:{port}"),
            "the server to be ready or to exit",
        )
        assert process.poll() is None, _finish(process, None)
    finally:
        out = _finish(process)
    assert process.returncode == 0, out


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_a_module_target_in_the_working_directory_imports_with_the_carpool_script(
    tmp_path: Path, command: str
) -> None:
    # The same for the tools' module:attr targets: `carpool bench beside:fn` failed with
    # "No module named 'beside'" where `python -m carpool.cli bench` worked.
    (tmp_path / "beside.py").write_text("def fn(batch):\n    return batch * 2\n")
    args = {
        "bench": ["--input-shape", "1,4", "--duration", "0.3s", "--concurrency", "2"],
        "doctor": ["--shape", "4", "--max-batch", "4", "--repeats", "1", "--warmup", "0"],
    }[command]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(CARPOOL), command, "beside:fn", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=RUN_LIMIT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No module named" not in done.stderr


# -- ports ---------------------------------------------------------------------------------------


def test_same_http_and_grpc_port_is_a_usage_error(tmp_path: Path) -> None:
    # It loaded the models, bound gRPC, then died with uvicorn's own "[Errno 98]" line.
    config = tmp_path / "serve.yaml"
    config.write_text(MODEL)
    port = str(free_port())
    done = _serve(str(config), "--port", port, "--grpc-port", port, cwd=tmp_path)
    assert done.returncode == 2
    assert "--grpc-port" in done.stderr and "is the HTTP port" in done.stderr, done.stderr
    assert "ready" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("which", ["--port", "--grpc-port"])
def test_a_taken_port_fails_before_any_model_loads(gated: Gated, which: str) -> None:
    # The ports were bound after every model had loaded (minutes, for a large one), and a
    # taken HTTP port was uvicorn's "ERROR: [Errno 98] ..." line, not carpool's.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = str(busy.getsockname()[1])
        other = str(free_port())
        ports = {"--port": other, "--grpc-port": other, which: taken}
        flags = [arg for flag, port in ports.items() for arg in (flag, port)]
        done = _serve(str(gated.config), *flags, cwd=gated.folder, env=gated.env)
    assert done.returncode == 3, done.stderr
    line = _one_line_error(done)
    wire = "HTTP" if which == "--port" else "gRPC"
    assert line.startswith(f"carpool serve: {wire} port 127.0.0.1:{taken}: could not bind")
    assert not gated.loading.exists(), "a model started loading before the port was bound"
    assert "ERROR:" not in done.stderr


def test_a_second_server_on_the_same_ports_fails_at_once_while_the_first_loads(
    tmp_path: Path,
) -> None:
    """Was: both ports were held, while the models loaded, by sockets bound with
    SO_REUSEADDR and not listening, which Linux lets any other socket with SO_REUSEADDR
    bind as well (uvicorn's, grpcio's, a second ``carpool serve``'s). Before the gRPC
    port was held that way grpcio listened on it, so a second server failed at once; now
    a second ``carpool serve`` on the same ports passed its check, loaded, and took both
    ports over, and the first failed once its models were loaded. The ports are now held
    exclusively (SO_REUSEADDR only where a closed connection's TIME_WAIT needs it)."""
    folder = tmp_path / "gated"
    folder.mkdir()
    gated = Gated(folder, "replica")
    port, grpc_port = free_port(), free_port()
    ports = ("--port", str(port), "--grpc-port", str(grpc_port))
    first = _start(str(gated.config), *ports, cwd=folder, env=gated.env)
    second = None
    try:
        wait_until(lambda: gated.loading.exists() or first.poll() is not None, "loading")
        other = tmp_path / "other"
        other.mkdir()
        (other / "serve.yaml").write_text(MODEL)
        second = _start(str(other / "serve.yaml"), *ports, cwd=other)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: second.poll() is not None or _is_ready(url), "the second to end")
        out = _finish(second)
        assert second.returncode == 3, out
        assert f"port 127.0.0.1:{port}: could not bind" in out, out
        gated.gate.unlink()
        wait_until(lambda: _is_ready(url) or first.poll() is not None, "the first ready")
        assert first.poll() is None
    finally:
        if second is not None and second.poll() is None:
            _finish(second)
        gated.gate.unlink(missing_ok=True)
        out = _finish(first)
    assert first.returncode == 0, out


def test_ipv6_loopback_serves_both_wires_with_bracketed_addresses(tmp_path: Path) -> None:
    # gRPC was bound as "::1:PORT" (grpcio: "Misformatted domain name"), reported as
    # "could not bind (address in use?)"; the ready line said http://::1:PORT.
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    config = tmp_path / "serve.yaml"
    config.write_text(MODEL)
    port, grpc_port = free_port(), free_port()
    args = ("--host", "::1", "--port", str(port), "--grpc-port", str(grpc_port))
    process = _start(str(config), *args, cwd=tmp_path)
    try:
        wait_until(
            lambda: process.poll() is not None or _is_ready(f"http://[::1]:{port}"),
            "the server to be ready or to exit",
        )
        assert process.poll() is None, _finish(process, None)
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"[::1]:{grpc_port}")
        try:
            wait_until(lambda: client.is_server_ready(client_timeout=5.0), "gRPC readiness")
        finally:
            client.close()
    finally:
        out = _finish(process)
    assert process.returncode == 0, out
    assert f"http://[::1]:{port}" in out and f"gRPC  [::1]:{grpc_port}" in out, out


HERE = Path(__file__).resolve().parent


# The python model of the serve-config tests, without the ONNX one (its file is built there).
CONFIG = SERVE_CONFIG.split("  - name: affine")[0]


def _run_serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str] | None:
    """The finished ``carpool serve``, or None when it was still serving after 20 s."""
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config), *flags]
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=20)
    except subprocess.TimeoutExpired:  # subprocess.run kills the child
        return None


def test_grpc_port_in_use_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _run_serve(tmp_path, "--port", "0", "--grpc-port", str(port))
    assert done is not None and done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-600:]


def test_http_port_out_of_range_is_refused(tmp_path: Path) -> None:
    # Was: it served on 70000 - 65536 = 4464 while logging ...:70000.
    done = _run_serve(tmp_path, "--port", "70000", "--grpc-port", "0")
    assert done is not None, "carpool serve --port 70000 started serving"
    assert done.returncode == 2


# -- lifecycle -----------------------------------------------------------------------------------


def test_grpc_is_refused_at_once_while_loading_and_its_port_held(tmp_path: Path) -> None:
    # gRPC listened from the moment its port was bound, before the models loaded: a call
    # then waited for the whole load (here DEADLINE_EXCEEDED after client_timeout) where
    # HTTP refused the connection. Triton starts both endpoints after its models load.
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    folder = tmp_path / "gated"
    folder.mkdir()
    gated = Gated(folder, "replica")
    port, grpc_port = free_port(), free_port()
    process = _start(
        str(gated.config), "--port", str(port), "--grpc-port", str(grpc_port),
        cwd=folder, env=gated.env,
    )  # fmt: skip
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        wait_until(lambda: gated.loading.exists() or process.poll() is not None, "loading")
        with pytest.raises(InferenceServerException) as caught:
            client.is_server_live(client_timeout=10.0)
        assert caught.value.status() == "StatusCode.UNAVAILABLE", caught.value
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", grpc_port))  # held for carpool while loading
        gated.gate.unlink()
        wait_until(lambda: _is_ready(f"http://127.0.0.1:{port}"), "ready")
        # A new channel, of its own: the refused one backs off before it connects again
        # (as against Triton while it loads), and gRPC shares subchannels by default.
        ready = grpcclient.InferenceServerClient(
            f"127.0.0.1:{grpc_port}", channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            assert ready.is_server_ready()
            assert ready.is_model_ready("m")
        finally:
            ready.close()
    finally:
        client.close()
        out = _finish(process)
    assert process.returncode == 0, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_loading_exits_0_at_once_saying_so(gated: Gated, signum: int) -> None:
    # SIGTERM killed the process by the signal (status -15, no line); SIGINT waited for the
    # load to end and exited 130 without a word.
    port = free_port()
    process = _start(
        str(gated.config), "--port", str(port), "--grpc-port", "0",
        cwd=gated.folder, env=gated.env,
    )  # fmt: skip
    try:
        wait_until(lambda: gated.loading.exists() or process.poll() is not None, "loading")
        assert not _is_ready(f"http://127.0.0.1:{port}")  # nothing listens while loading
        process.send_signal(signum)
        out = _finish(process, None)  # the gate stays: the load never ends by itself
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, out
    name = signal.Signals(signum).name
    assert f"stopping: {name} while the models were loading" in out, out
    assert "model(s) ready" not in out and "Traceback" not in out, out


NEVER_PLACED = """\
models:
  - name: m
    kind: python
    source: numpy:negative
    inputs: [{name: x, datatype: FP32, shape: [4]}]
    outputs: [{name: y, datatype: FP32, shape: [4]}]
    executor: ray
    ray_resources: {num_cpus: 0, carpool_test_absent: 1}
"""


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid``, from /proc (those Ray starts for a driver)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_a_local_ray_replica_loads_exits_0_and_stops_that_ray(
    tmp_path: Path, signum: int
) -> None:
    """Was: SIGTERM ended the server through Ray's own handler (status 15, Ray's dump),
    and SIGINT exited 0 but left the local Ray's agents running, reparented to init."""
    pytest.importorskip("ray")
    config = tmp_path / "serve.yaml"
    config.write_text(NEVER_PLACED)  # its actor waits for a resource no node has
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(CARPOOL), "serve", str(config), "--port", str(free_port()), "--grpc-port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_until(
            lambda: "started a local one" in log.read_text() or process.poll() is not None,
            "the local Ray started",
        )
        ray_processes = _descendants(process.pid)
        assert ray_processes, log.read_text()
        process.send_signal(signum)
        process.wait(timeout=RUN_LIMIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert process.returncode == 0, text
    assert f"stopping: {signal.Signals(signum).name} while the models were loading" in text
    assert "SIGTERM received" not in text, text
    wait_until(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in ray_processes),
        "the local Ray's processes ended",
    )
