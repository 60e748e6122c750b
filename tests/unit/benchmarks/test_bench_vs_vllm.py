"""bench_vs_vllm's lone-prefill timing: prompts that share no first token, sent as a
completions request asking for one greedy token, one warm-up left out."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bench_vs_vllm import prefill_ms, prompt_ids


def test_prompt_ids_stay_in_the_vocabulary_past_the_specials_and_differ_from_the_start() -> None:
    prompts = [prompt_ids(300, 2000, repeat) for repeat in range(8)]
    assert all(len(p) == 300 for p in prompts)
    assert all(5 <= token < 2000 for p in prompts for token in p)
    assert len({p[0] for p in prompts}) == len(prompts)  # no cached prefix to reuse


@pytest.fixture
def completions() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """A loopback server answering POST /v1/completions; the bodies it was sent."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/completions"
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            answer = b'{"choices": [{"text": "x"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], bodies
    finally:
        server.shutdown()
        server.server_close()


def test_prefill_ms_times_each_repeat_after_a_warm_up(
    completions: tuple[int, list[dict[str, Any]]],
) -> None:
    port, bodies = completions
    times = prefill_ms(port, "small", 2000, 64, repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert len(bodies) == 4  # the warm-up, untimed, then the three
    assert all(b["max_tokens"] == 1 and b["temperature"] == 0 for b in bodies)
    assert all(b["model"] == "small" and len(b["prompt"]) == 64 for b in bodies)
    assert len({b["prompt"][0] for b in bodies}) == 4
