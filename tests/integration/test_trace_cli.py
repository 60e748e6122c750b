"""``carpool trace URL --seconds S --out trace.json`` against a real server under a bounded
load from ``tritonclient``: the file is checked against the Chrome trace-event format as
Perfetto reads it (keys per phase, flows bound to slices, one track per replica)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

from .conftest import ServedProcess, StartServer

TRACE_TIMEOUT_S = 120.0  # a net against a hung run, not a timing assertion
MAX_REQUESTS = 400  # the load's bound, per client thread
NUM_REPLICAS = 2
CONFIG = """\
models:
  - name: doubler
    kind: python
    source: configmodels:slow_double
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 8
    max_delay_s: 0.002
    num_replicas: 2
"""
_REQUIRED = {
    "X": {"name", "ph", "pid", "tid", "ts", "dur"},
    "M": {"name", "ph", "pid", "tid", "args"},
    "s": {"name", "cat", "ph", "pid", "tid", "ts", "id"},
    "f": {"name", "cat", "ph", "pid", "tid", "ts", "id", "bp"},
}


def check_trace_events(document: dict[str, Any]) -> None:
    """Fail unless ``document`` is well-formed trace-event JSON of the shape carpool
    writes: known phases with their keys, slices nested per track, flows in pairs bound
    to an enclosing slice at each end, every track named."""
    events = document["traceEvents"]
    assert isinstance(events, list) and events
    slices: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    names: dict[tuple[int, int], str] = {}
    flows: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for event in events:
        ph = event["ph"]
        assert ph in _REQUIRED, event
        assert _REQUIRED[ph] <= event.keys(), (ph, event)
        track = (event["pid"], event["tid"])
        if ph == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0, event
            slices[track].append((event["ts"], event["ts"] + event["dur"]))
        elif ph == "M" and event["name"] == "thread_name":
            names[track] = event["args"]["name"]
        elif ph in "sf":
            assert ph not in flows[event["id"]], f"two {ph} events for flow {event['id']}"
            flows[event["id"]][ph] = event
    for track, spans in slices.items():
        assert track in names, f"track {track} has slices and no thread_name"
        _check_nesting(track, sorted(spans, key=lambda s: (s[0], -s[1])))
    for flow_id, ends in flows.items():
        assert ends.keys() == {"s", "f"}, (flow_id, ends)
        assert ends["f"]["bp"] == "e"
        assert ends["s"]["ts"] <= ends["f"]["ts"], ends
        for end in ends.values():
            track = (end["pid"], end["tid"])
            assert any(a <= end["ts"] <= b for a, b in slices[track]), (
                f"flow {flow_id} {end['ph']} at {end['ts']} binds to no slice of {track}"
            )


def _check_nesting(track: tuple[int, int], spans: list[tuple[float, float]]) -> None:
    open_ends: list[float] = []
    for start, end in spans:
        while open_ends and open_ends[-1] <= start + 1e-3:  # rounded to the nanosecond
            open_ends.pop()
        assert not open_ends or end <= open_ends[-1] + 1e-3, (
            f"slice {start}..{end} overlaps its parent on {track} without nesting"
        )
        open_ends.append(end)


def _start_trace(served: ServedProcess, out: Path) -> subprocess.Popen[str]:
    """``carpool trace`` of ``served`` for 2 seconds into ``out``, started."""
    return subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "trace", f"http://{served.http_url}",
         "--seconds", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _load(url: str, stop: threading.Event, counts: list[int]) -> None:
    client = httpclient.InferenceServerClient(url)
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(data)
    try:
        for _ in range(MAX_REQUESTS):
            if stop.is_set():
                break
            result = client.infer("doubler", [tensor])
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
            counts.append(1)
    finally:
        client.close()


def test_trace_has_a_track_per_replica_batches_as_slices_and_requests_as_flows(
    start_server: StartServer, tmp_path: Path
) -> None:
    served = start_server(CONFIG)
    out = tmp_path / "trace.json"
    trace = _start_trace(served, out)
    stop, counts = threading.Event(), []  # type: ignore[var-annotated]
    threads = [
        threading.Thread(target=_load, args=(served.http_url, stop, counts)) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    try:
        output, _ = trace.communicate(timeout=TRACE_TIMEOUT_S)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert trace.returncode == 0, output
    assert f"wrote {out}" in output
    document = json.loads(out.read_text())
    check_trace_events(document)
    events = document["traceEvents"]
    processes = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert [p["args"]["name"] for p in processes] == ["model doubler"]
    replica_tracks = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"].startswith("replica")
    }
    assert sorted(replica_tracks.values()) == [f"replica {r}" for r in range(NUM_REPLICAS)]
    batches = [e for e in events if e.get("cat") == "batch"]
    requests = [e for e in events if e.get("cat") == "request"]
    assert batches and requests
    assert {b["tid"] for b in batches} == set(replica_tracks)
    assert max(b["args"]["num_requests"] for b in batches) > 1  # the load made batches
    batched = {i for b in batches for i in b["args"]["request_ids"]}
    assert {int(r["name"].split()[1]) for r in requests} == batched
    assert len([e for e in events if e["ph"] == "s"]) == len(requests)
    assert document["otherData"]["num_requests"] == len(requests) <= sum(counts)


def test_trace_of_an_unreachable_server_exits_1(tmp_path: Path) -> None:
    from .conftest import free_port

    run = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "trace", f"http://127.0.0.1:{free_port()}",
         "--seconds", "1", "--out", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=TRACE_TIMEOUT_S,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "carpool trace: http://127.0.0.1:" in run.stderr
    assert not (tmp_path / "t.json").exists()


def _complete(url: str, num_requests: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://{url}/v1", api_key="unused")
    for _ in range(num_requests):
        client.completions.create(model="tiny-random-llama", prompt="hello", max_tokens=4)
    client.close()


def test_generation_requests_are_steps_on_the_engine_track(
    start_server: StartServer, tmp_path: Path
) -> None:
    served = start_server(None)  # the built-in models: tiny-random-llama generates
    out = tmp_path / "trace.json"
    trace = _start_trace(served, out)
    threads = [threading.Thread(target=_complete, args=(served.http_url, 20)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    output, _ = trace.communicate(timeout=TRACE_TIMEOUT_S)
    assert trace.returncode == 0, output
    document = json.loads(out.read_text())
    check_trace_events(document)
    events = document["traceEvents"]
    pids = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    pid = pids["model tiny-random-llama"]
    mine = [e for e in events if e["pid"] == pid]
    steps = [e for e in mine if e.get("cat") == "step"]
    requests = [e for e in mine if e.get("cat") == "request"]
    assert steps and requests
    assert {e["tid"] for e in steps} == {1}
    # A request stops at 4 tokens or an end of sequence; one already running when the
    # recording began shows only the steps since.
    assert all(1 <= r["args"]["num_generated"] <= 4 for r in requests)
    assert all(r["args"]["num_steps"] >= 1 for r in requests)
    assert any(r["args"]["num_steps"] >= r["args"]["num_generated"] for r in requests)
    stages = {e["name"] for e in mine if e.get("cat") == "stage"}
    assert {"prefill", "decode"} <= stages
    assert len([e for e in mine if e["ph"] == "f"]) == len(requests)
