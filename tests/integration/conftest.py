"""Shared helper: `carpool serve CONFIG.yaml` as a subprocess on loopback."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True, scope="session")
def _tritonclient_http_collected_on_any_thread() -> Iterator[None]:
    """tritonclient.http's client closes itself again in ``__del__``, joining its gevent
    pool; when the cyclic collector happens to run on another thread (a test's load
    thread) than the one whose hub made the client, that join raises
    InvalidThreadUseError, an unraisable exception pytest then reports against whichever
    test is running (seen once in a full run). Tests close their clients; the finalizer's
    second close has nothing left to join, so that one error is dropped there."""
    import tritonclient.http as httpclient
    from gevent.exceptions import InvalidThreadUseError

    original = httpclient.InferenceServerClient.__del__

    def finalize(client: httpclient.InferenceServerClient) -> None:
        with contextlib.suppress(InvalidThreadUseError):
            original(client)

    httpclient.InferenceServerClient.__del__ = finalize  # type: ignore[method-assign]
    yield
    httpclient.InferenceServerClient.__del__ = original  # type: ignore[method-assign]


SendOne = Callable[[int], "str | None"]


class Steady:
    """Good requests one after the other on a thread while a test abuses the server,
    until ``check``, which asserts every one was answered right. ``session`` opens the
    clients and gives the function that sends request ``i``: None when its answer is
    right, else what was wrong (an exception it raises counts as wrong too)."""

    def __init__(self, session: Callable[[], contextlib.AbstractContextManager[SendOne]]) -> None:
        self.answered = 0
        self.failures: list[str] = []
        self._session = session
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._session() as send:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    wrong = send(i)
                except Exception as error:
                    wrong = repr(error)
                if wrong is None:
                    self.answered += 1
                else:
                    self.failures.append(wrong)
                self._stop.wait(0.005)  # a steady trickle, not a timing check

    def check(self) -> None:
        start = self.answered
        wait_until(lambda: self.answered > start + 3, "good requests to go on being answered")
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self.failures, self.failures[:5]


def rss_kb(pid: int) -> int:
    """A process's resident memory (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def serve_on_thread(repository: Any, **kwargs: Any) -> BaseException | None:
    """Run ``carpool.server.run.serve(repository, **kwargs)`` on a thread (no signal
    handlers there) to its end; what it raised, None if it returned. Fails after 60 s."""
    from carpool.server.run import serve

    raised: list[BaseException] = []

    def run() -> None:
        try:
            serve(repository, **kwargs)
        except BaseException as error:  # whatever it is, the test shows it
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "serve() did not return within 60 s"
    return raised[0] if raised else None


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel picked for
    `bind(0)` can be picked again for another socket (a client's, another test worker's)
    before the server under test binds it, which made a server fail to start. From 20000:
    Ray's workers take ports from 10000 to 19999 (tests/integration/test_ray.py)."""
    low, _ = _ephemeral_range()
    choices = random.Random(os.urandom(8))
    for _attempt in range(200):
        port = choices.randrange(20_000, max(low, 20_001))
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # nothing free below the range: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServedProcess:
    """A running `carpool serve`; its stdout and stderr go to ``log``."""

    process: subprocess.Popen[bytes]
    http_url: str
    grpc_url: str | None
    log: Path
    stopped: bool = field(default=False)

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after STOP_TIMEOUT_S: a failure)."""
        if self.stopped:
            return self.process.returncode
        self.stopped = True
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"carpool serve did not exit after SIGTERM:\n{self.output()}")


# One batched model, OUTPUT0 = 2 * INPUT0, for tests about the server rather than a model.
DOUBLER_CONFIG = """\
models:
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 8
    max_delay_s: 0.001
"""
StartServer = Callable[..., ServedProcess]
WAIT_LIMIT_S = 30.0  # a net against a hung test, never a timing assertion


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie that nobody reaped yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], object], what: str) -> None:
    """Poll ``condition`` (another process's state) until it holds; fail naming ``what``
    after WAIT_LIMIT_S."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {WAIT_LIMIT_S} s waiting for {what}")
        time.sleep(0.01)  # polling for a state change, not a timing check


def start_served_process(
    config_text: str | None,
    folder: Path,
    *,
    grpc: bool = False,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    ports: tuple[int, int] | None = None,
) -> ServedProcess:
    """Write ``config_text`` to ``folder/serve.yaml`` and serve it on 127.0.0.1 (HTTP, and
    gRPC when ``grpc``); python model sources import from this folder (configmodels).
    With ``config_text=None`` the built-in models are served. ``args``: more options of
    `carpool serve`; ``ports``: the HTTP and gRPC ports (else free ones)."""
    config_args: list[str] = []
    if config_text is not None:
        config = folder / "serve.yaml"
        config.write_text(config_text, encoding="utf-8")
        config_args = [str(config)]
    for attempt in range(3):
        try:
            return _start_served_process(config_args, folder, grpc, env, args, ports)
        except _PortTaken as taken:
            if ports is not None or attempt == 2:
                pytest.fail(f"carpool serve did not become ready:\n{taken}")
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """The server under test could not bind a port it was given: another process took it
    between the check and the bind."""


def _start_served_process(
    config_args: list[str],
    folder: Path,
    grpc: bool,
    env: dict[str, str] | None,
    args: list[str] | None,
    ports: tuple[int, int] | None,
) -> ServedProcess:
    port, grpc_port = ports or (free_port(), free_port())
    grpc_port = grpc_port if grpc else 0
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        **(env or {}),
    }
    log = folder / f"serve-{port}.log"
    command = [sys.executable, "-m", "carpool.cli", "serve", *config_args]
    command += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)]
    command += args or []
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=full_env, cwd=str(folder)
        )
    served = ServedProcess(
        process,
        f"127.0.0.1:{port}",
        f"127.0.0.1:{grpc_port}" if grpc else None,
        log,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _is_ready(served):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            if "could not bind" in served.output():
                raise _PortTaken(served.output())
            pytest.fail(f"carpool serve did not become ready:\n{served.output()}")
        time.sleep(0.1)  # polling a subprocess's readiness, not a timing assertion
    return served


def _is_ready(served: ServedProcess) -> bool:
    try:
        response = httpx.get(f"http://{served.http_url}/v2/health/ready", timeout=1.0)
    except httpx.TransportError:
        return False
    if response.status_code != 200:
        return False
    if served.grpc_url is None:
        return True
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        return bool(client.is_server_ready(client_timeout=1.0))
    except InferenceServerException:
        return False
    finally:
        client.close()


@pytest.fixture(scope="module")
def builtin_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    """`carpool serve` with the built-in models (``tiny-random-llama`` among them), one
    server for the test module that asks for it."""
    server = start_served_process(None, tmp_path_factory.mktemp("builtin"))
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture
def openai_client(builtin_served: ServedProcess) -> Iterator[openai.OpenAI]:
    """The official ``openai`` client on ``builtin_served``, without retries."""
    url = f"http://{builtin_served.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="-", max_retries=0) as client:
        yield client


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """``start_server(config_text, grpc=..., env=..., args=...)`` starts a server for this test; the
    ones the test did not stop itself are stopped afterwards and must exit 0."""
    started: list[ServedProcess] = []

    def start(
        config_text: str,
        *,
        grpc: bool = False,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> ServedProcess:
        folder = tmp_path / f"server{len(started)}"
        folder.mkdir()
        served = start_served_process(config_text, folder, grpc=grpc, env=env, args=args)
        started.append(served)
        return served

    yield start
    for served in started:
        if not served.stopped:
            assert served.stop() == 0, served.output()
