"""``carpool serve --workers 2``: two front-end worker processes on the same ports, one
engine owning the batchers, driven by real clients on loopback.

tritonclient (HTTP and gRPC) gets the answers ``--workers 1`` gives; new connections
spread over both workers (their counters in ``/metrics``); ``/metrics``, ``/stats`` and
``/policy`` are the engine's whichever worker answers; SIGTERM with requests held in
the model on every worker answers each one and exits 0; a worker killed with SIGKILL is
started again while the other keeps serving.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import (
    DOUBLER_CONFIG,
    HERE,
    ServedProcess,
    StartServer,
    free_port,
    start_served_process,
    wait_until,
)

# The doubler with two priority classes, and a model that holds its requests at a gate.
CONFIG = (
    DOUBLER_CONFIG
    + """\
    classes: [{name: interactive}, {name: normal}]
  - name: gated
    kind: python
    source: configmodels:gated
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 1
"""
)
NUM_CONNECTIONS = 24  # new connections: all on one of two workers once in 8 million runs
NUM_HELD = 6


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    return {
        "CARPOOL_TEST_SEEN": str(tmp_path / "seen"),
        "CARPOOL_TEST_GATE": str(tmp_path / "gate"),
    }


@pytest.fixture
def served(start_server: StartServer, files: dict[str, str]) -> ServedProcess:
    started = start_server(
        CONFIG, grpc=True, env=files, args=["--workers", "2", "--allow-policy-updates"]
    )
    # Ready as soon as one worker answers; the engine says so once both listen.
    wait_until(lambda: "front-end workers share" in started.output(), "both workers")
    return started


def _samples(served: ServedProcess, name: str, model: str = "doubler") -> dict[str, float]:
    """``name``'s samples by their ``worker`` (else ``reason``, else ``class``) label, from
    /metrics; of a model's, only ``model``'s."""
    text = httpx.get(f"http://{served.http_url}/metrics").text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == name and labels.get("model", model) == model:
                key = labels.get("worker") or labels.get("reason") or labels.get("class", "")
                found[key] = found.get(key, 0) + sample.value
    return found


def _infer_http(url: str, x: np.ndarray, **kwargs: object) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    try:
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("doubler", [tensor], **kwargs).as_numpy("OUTPUT0")  # type: ignore[arg-type]
    finally:
        client.close()


def _infer_grpc(url: str, x: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("doubler", [tensor]).as_numpy("OUTPUT0")
    finally:
        client.close()


def test_tritonclient_gets_the_answers_of_one_worker(
    served: ServedProcess, tmp_path: Path, files: dict[str, str]
) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    folder = tmp_path / "one"
    folder.mkdir()
    one = start_served_process(CONFIG, folder, grpc=True, env=files)
    try:
        assert one.grpc_url is not None and served.grpc_url is not None
        expected = _infer_http(one.http_url, x)
        assert np.array_equal(_infer_http(served.http_url, x), expected)
        assert np.array_equal(_infer_grpc(served.grpc_url, x), _infer_grpc(one.grpc_url, x))
        client = grpcclient.InferenceServerClient(served.grpc_url)
        try:
            assert client.get_model_config("doubler").config.max_batch_size == 8
            (stats,) = client.get_inference_statistics("doubler").model_stats
            assert stats.inference_count >= 2  # the engine's: both wires counted
        finally:
            client.close()
    finally:
        assert one.stop() == 0, one.output()
    np.testing.assert_array_equal(expected, 2 * x)


def test_grpc_config_and_statistics_of_an_unknown_name_or_version_are_refused_as_in_one_process(
    served: ServedProcess,
) -> None:
    """Was: a worker sent the name and version to the engine percent-encoded, so the
    NOT_FOUND quoted them encoded ('%C3%ABcho', '1%20'), and a version of 30 MB took
    seconds of the worker's loop to encode, stalling its other connections."""
    assert served.grpc_url is not None
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        for name, version, expected in (
            ("ëcho", "", "model 'ëcho' not found"),
            ("doubler", "1 ", "version '1 ' of model 'doubler' not found"),
            ("", "1", "model '' not found"),
            ("doubler", "é" * 3_000_000, "not found"),
        ):
            asks = [client.get_model_config, client.get_inference_statistics]
            for ask in asks[: 1 if not name else 2]:  # statistics of no name: every model's
                with pytest.raises(InferenceServerException) as refused:
                    ask(name, version)
                assert refused.value.status() == "StatusCode.NOT_FOUND"
                assert expected in refused.value.message()
                assert len(refused.value.message()) < 1000
        assert client.get_model_config("doubler", "1").config.name == "doubler"
    finally:
        client.close()


def test_new_connections_spread_over_both_workers_and_metrics_agree(
    served: ServedProcess,
) -> None:
    x = np.ones((1, 2), dtype=np.float32)
    for _ in range(NUM_CONNECTIONS):  # a new connection each: the kernel picks a worker
        assert np.array_equal(_infer_http(served.http_url, x), 2 * x)
    handoffs = _samples(served, "carpool_worker_handoffs_total")
    assert set(handoffs) == {"0", "1"}
    assert all(count > 0 for count in handoffs.values()), handoffs
    # The engine answers every scrape and every /stats: the same counts on each.
    completed = {_samples(served, "carpool_requests_completed_total")["normal"] for _ in range(6)}
    assert completed == {NUM_CONNECTIONS}
    stats_url = f"http://{served.http_url}/v2/models/doubler/stats"
    counts = {httpx.get(stats_url).json()["model_stats"][0]["inference_count"] for _ in range(6)}
    assert counts == {NUM_CONNECTIONS}


def test_vllm_probes_are_answered_through_the_workers(served: ServedProcess) -> None:
    """``GET /health`` from the worker's head (as ``/v2/health/ready``), ``POST /ping``
    forwarded to the engine: both 200 once every model is ready."""
    base = f"http://{served.http_url}"
    for _ in range(4):  # new connections: both workers
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.post(f"{base}/ping").status_code == 200


def test_the_dashboard_and_the_live_figures_come_from_the_engine(served: ServedProcess) -> None:
    x = np.ones((1, 2), dtype=np.float32)
    for _ in range(4):
        assert np.array_equal(_infer_http(served.http_url, x), 2 * x)
    base = f"http://{served.http_url}"
    # Whichever worker is asked, the engine's figures: the dashboard samples there.
    assert "uPlot" in httpx.get(f"{base}/dashboard").text
    live = httpx.get(f"{base}/v2/models/doubler/stats").json()["model_stats"][0]["carpool"]
    assert live["num_items"] >= 4

    def sampled() -> bool:
        doubler = httpx.get(f"{base}/dashboard/series").json()["models"].get("doubler")
        return doubler is not None and len(doubler["t"]) > 0

    wait_until(sampled, "a dashboard sample of the model")


def test_a_policy_change_is_seen_through_every_worker(served: ServedProcess) -> None:
    url = f"http://{served.http_url}/v2/models/doubler/policy"
    reply = httpx.post(url, json={"default_class": "interactive"})
    assert reply.status_code == 200, reply.text
    x = np.ones((1, 1), dtype=np.float32)
    for _ in range(NUM_CONNECTIONS):
        assert httpx.get(url).json()["default_class"] == "interactive"
        _infer_http(served.http_url, x)
    assert all(count > 0 for count in _samples(served, "carpool_worker_handoffs_total").values())
    assert (
        _samples(served, "carpool_requests_completed_total").get("interactive") == NUM_CONNECTIONS
    )
    # A priority level is read by the worker from the policy it was given.
    _infer_http(served.http_url, x, priority=2)
    assert _samples(served, "carpool_requests_completed_total")["normal"] == 1


def _worker_pids(engine_pid: int) -> list[int]:
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    pids = []
    for pid in map(int, children):
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in command:  # not the resource tracker
            pids.append(pid)
    return pids


def _held_requests(
    served: ServedProcess, gate: Path, num_held: int = NUM_HELD
) -> Iterator[list[object]]:
    """``num_held`` requests to the gated model, each on its own connection, held in the
    engine until the gate goes; what each got back."""
    answers: list[object] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        try:
            reply = httpx.post(
                f"http://{served.http_url}/v2/models/gated/infer",
                json={"inputs": [{"name": "X", "datatype": "INT64", "shape": [1, 1], "data": [i]}]},
                timeout=60,
            )
            answer: object = (reply.status_code, reply.json()["outputs"][0]["data"])
        except Exception as error:
            answer = repr(error)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(num_held)]
    for thread in threads:
        thread.start()
    yield answers
    gate.unlink()
    for thread in threads:
        thread.join(timeout=60)


def test_sigterm_answers_what_every_worker_accepted_and_exits_0(
    served: ServedProcess, files: dict[str, str]
) -> None:
    gate = Path(files["CARPOOL_TEST_GATE"])
    gate.touch()
    holding = _held_requests(served, gate)
    answers = next(holding)

    def held_on_both() -> bool:
        inflight = _samples(served, "carpool_worker_inflight")
        return sum(inflight.values()) >= NUM_HELD + 1 and min(inflight.values()) > 0

    wait_until(held_on_both, "requests held on both workers")  # +1: this scrape
    served.process.send_signal(signal.SIGTERM)
    served.stopped = True
    wait_until(lambda: "stopping" in served.output(), "the engine to take the signal")
    next(holding, None)
    assert served.process.wait(timeout=60) == 0, served.output()
    assert sorted(answers, key=str) == sorted(((200, [i]) for i in range(NUM_HELD)), key=str)


def test_a_client_that_leaves_withdraws_its_queued_request_from_the_engine(
    served: ServedProcess, files: dict[str, str]
) -> None:
    gate, seen = Path(files["CARPOOL_TEST_GATE"]), Path(files["CARPOOL_TEST_SEEN"])
    gate.touch()
    holding = _held_requests(served, gate, num_held=1)  # holds the one replica
    answers = next(holding)
    wait_until(seen.exists, "the model to hold the first request")
    body = b'{"inputs":[{"name":"X","datatype":"INT64","shape":[1,1],"data":[99]}]}'
    head = f"POST /v2/models/gated/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    host, port = served.http_url.split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(head.encode() + body)
        wait_until(
            lambda: _samples(served, "carpool_pending_requests", "gated").get("normal") == 1,
            "the second request to wait in the engine's queue",
        )
    wait_until(
        lambda: _samples(served, "carpool_rejections_total", "gated").get("cancelled") == 1,
        "the engine to withdraw it",
    )
    next(holding, None)
    assert answers == [(200, [0])]
    assert "99" not in seen.read_text().split()  # the model never saw it


def test_a_killed_worker_is_started_again_and_serving_goes_on(served: ServedProcess) -> None:
    pids = _worker_pids(served.process.pid)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    wait_until(
        lambda: (
            _samples(served, "carpool_worker_restarts_total").get("0", 0)
            + _samples(served, "carpool_worker_restarts_total").get("1", 0)
            == 1
        ),
        "the killed worker to be started again",
    )
    wait_until(lambda: len(_worker_pids(served.process.pid)) == 2, "two workers again")
    x = np.ones((1, 1), dtype=np.float32)
    for _ in range(NUM_CONNECTIONS):
        assert np.array_equal(_infer_http(served.http_url, x), 2 * x)
    assert "exited" in served.output()


def test_port_0_serves_on_the_port_the_ready_line_names(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "carpool.cli", "serve", str(config), "--workers", "2"]
    command += ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0"]  # gRPC 0: none
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
        )
    served = ServedProcess(process, "", None, log)
    try:
        wait_until(
            lambda: "front-end workers" in served.output() or process.poll() is not None,
            "the ready lines",
        )
        http = re.search(r"HTTP\s+http://127\.0\.0\.1:(\d+)", served.output())
        assert http is not None, served.output()
        assert http.group(1) != "0"
        x = np.ones((1, 3), dtype=np.float32)
        for _ in range(4):  # both workers listen on the port the engine holds
            assert np.array_equal(_infer_http(f"127.0.0.1:{http.group(1)}", x), 2 * x)
    finally:
        assert served.stop() == 0, served.output()


def test_a_taken_port_fails_at_once_before_the_models_load(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "carpool.cli", "serve", "--workers", "2"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert f"HTTP port 127.0.0.1:{port}: could not bind" in done.stderr


def _close_from_the_server(http_url: str, count: int = 4) -> None:
    """Requests with ``Connection: close``: the server closes first, and its side of each
    connection stays in TIME_WAIT."""
    host, port = http_url.rsplit(":", 1)
    for _ in range(count):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            while sock.recv(4096):
                pass


@pytest.mark.parametrize(
    ("first", "second"),
    [(["--workers", "2"], ["--workers", "2"]), ([], ["--workers", "2"]), (["--workers", "2"], [])],
    ids=["workers-then-workers", "one-then-workers", "workers-then-one"],
)
def test_a_restart_on_the_same_port_right_after_a_stop_serves(
    tmp_path: Path, first: list[str], second: list[str]
) -> None:
    """Was: with --workers, the next start on the port exited 3 ("Address already in use")
    while the connections the stopped server had closed were in TIME_WAIT (about 60 s):
    the workers' listeners and the other servers' checks set different options."""
    ports = (free_port(), free_port())
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    served = start_served_process(CONFIG, tmp_path / "first", args=first, ports=ports)
    _close_from_the_server(served.http_url)
    assert served.stop() == 0, served.output()
    again = start_served_process(CONFIG, tmp_path / "second", args=second, ports=ports)
    try:
        x = np.ones((1, 1), dtype=np.float32)
        assert np.array_equal(_infer_http(again.http_url, x), 2 * x)
    finally:
        assert again.stop() == 0, again.output()
