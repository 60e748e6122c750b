"""bench_vs_vllm's lone-prefill timing (prompts that share no first token, sent as a
completions request asking for one greedy token, one warm-up left out), and what it
records of carpool's kernels (its model config's string parameters)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench_vs_vllm import carpool_kernels, prefill_ms, prompt_ids


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
    parameters = {"decode_attention": "kernel", "linear": "carpool-packed", "huge_pages": "madvise"}
    config = {"name": "88m", "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    with loopback(json.dumps(config).encode()) as (port, asked):
        kernels = carpool_kernels(port, "88m")
    assert [(method, path) for method, path, _ in asked] == [("GET", "/v2/models/88m/config")]
    assert kernels == parameters
