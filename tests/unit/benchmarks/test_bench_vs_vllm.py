"""bench_vs_vllm's lone-prefill timing (prompts that share no first token, sent as a
completions request asking for one greedy token, one warm-up left out), and what it
records of carpool's kernels (its model config's string parameters)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench_vs_vllm import (
    busiest_thread_cpu_s,
    carpool_kernels,
    prefill_ms,
    prompt_ids,
    session_threads_cpu_s,
)


def test_prompt_ids_stay_in_the_vocabulary_past_the_specials_and_differ_from_the_start() -> None:
    prompts = [prompt_ids(300, 2000, repeat) for repeat in range(8)]
    assert all(len(p) == 300 for p in prompts)
    assert all(5 <= token < 2000 for p in prompts for token in p)
    assert len({p[0] for p in prompts}) == len(prompts)  # no cached prefix to reuse


@contextlib.contextmanager
def loopback(answer: bytes) -> Iterator[tuple[int, list[tuple[str, str, bytes]]]]:
    """A loopback HTTP server answering every GET and POST with ``answer`` (JSON); its
    port, and the (method, path, body) of each request it was sent."""
    asked: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            asked.append((self.command, self.path, body))
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], asked
    finally:
        server.shutdown()
        server.server_close()


def test_prefill_ms_times_each_repeat_after_a_warm_up() -> None:
    with loopback(b'{"choices": [{"text": "x"}]}') as (port, asked):
        times = prefill_ms(port, "small", 2000, 64, repeats=3)
    assert {(method, path) for method, path, _ in asked} == {("POST", "/v1/completions")}
    bodies = [json.loads(body) for _, _, body in asked]
    assert len(times) == 3 and all(t > 0 for t in times)
    assert len(bodies) == 4  # the warm-up, untimed, then the three
    assert all(b["max_tokens"] == 1 and b["temperature"] == 0 for b in bodies)
    assert all(b["model"] == "small" and len(b["prompt"]) == 64 for b in bodies)
    assert len({b["prompt"][0] for b in bodies}) == 4


def test_carpool_kernels_reads_the_model_configs_string_parameters() -> None:
    parameters = {
        "decode_attention": "kernel",
        "linear": "carpool-packed",
        "elementwise": "carpool-fused",
        "huge_pages": "madvise",
    }
    config = {"name": "88m", "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    with loopback(json.dumps(config).encode()) as (port, asked):
        kernels = carpool_kernels(port, "88m")
    assert [(method, path) for method, path, _ in asked] == [("GET", "/v2/models/88m/config")]
    assert kernels == parameters


# A process in a session of its own: its main thread waits while a second thread, told to
# go, spins for 0.6 s of CPU, says so, and sleeps (a thread that has ended is not listed).
SPINNER = """
import sys, threading, time
def spin():
    sys.stdin.readline()
    end = time.thread_time() + 0.6
    while time.thread_time() < end:
        pass
    print("spun", flush=True)
    time.sleep(60)
threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_the_busiest_thread_of_a_session_is_told_apart_from_the_rest() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", SPINNER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline().strip() == b"ready"
            before = session_threads_cpu_s(child.pid)
            main = f"{child.pid}/{child.pid}"
            assert main in before and len(before) == 2  # keyed pid/tid
            child.stdin.write(b"go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == b"spun"
            after = session_threads_cpu_s(child.pid)
            assert 0.55 <= busiest_thread_cpu_s(before, after) <= 0.9
            assert after[main] - before[main] < 0.1
        finally:
            child.kill()
    assert session_threads_cpu_s(child.pid) == {}  # no process of that session is left
