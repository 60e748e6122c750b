"""carpool top's loop pieces (carpool.tools.top): keys, and the poller against a server
faked with httpx's MockTransport (answering, then away, then back)."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import orjson

from carpool.tools.top import Poller, keys_of, press
from carpool.tools.top_view import TopState

from .test_top_view import batch_document, state

METRICS = b"""# TYPE carpool_adaptive_delay_seconds gauge
carpool_adaptive_delay_seconds{model="mlp",class="a"} 0.004
carpool_adaptive_delay_seconds{model="mlp",class="b"} 0.001
# TYPE carpool_adaptive_batch_size gauge
carpool_adaptive_batch_size{model="mlp",class="a"} 12
"""


def test_keys_of_reads_arrows_and_characters() -> None:
    assert keys_of(b"\x1b[Bq\x1b[A?s") == ["down", "q", "up", "?", "s"]


def test_keys_move_the_selection_within_the_models_cycle_the_sort_and_quit() -> None:
    first = state()
    assert press(first, "up") == first  # already at the top
    down = press(first, "down")
    assert down is not None and down.selected == 1
    assert press(down, "down") == down  # two models: stays on the last
    sorts = [first.sort_key]
    current: TopState | None = first
    for _ in range(3):
        assert current is not None
        current = press(current, "s")
        assert current is not None
        sorts.append(current.sort_key)
    assert sorts == ["name", "requests/s", "p99", "name"]
    helped = press(first, "?")
    assert helped is not None and helped.show_help
    assert press(first, "q") is None


class FakeServer:
    """Answers /v2/models/stats with a document whose counters grow by 10 each fetch, and
    /metrics with the adaptive gauges; ``is_up`` False: every connection refused."""

    def __init__(self) -> None:
        self.is_up = True
        self.num_fetches = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.is_up:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, content=METRICS)
        self.num_fetches += 1
        document: dict[str, Any] = copy.deepcopy(batch_document())
        document["num_completed"] = document["num_items"] = 10 * self.num_fetches
        document["num_batches"] = self.num_fetches
        stats = [{"name": "mlp", "inference_count": 0, "carpool": document}]
        return httpx.Response(200, content=orjson.dumps({"model_stats": stats}))


def test_poller_gives_rates_reconnects_and_starts_over_when_the_server_returns() -> None:
    server = FakeServer()
    with httpx.Client(transport=httpx.MockTransport(server), base_url="http://x") as client:
        poller = Poller(client)
        first = poller.poll(TopState("http://x"))
        (view,) = first.models
        assert view.rates["requests_per_s"] is None  # one fetch: no rate yet
        assert first.adaptive == {"mlp": {"delay_s": 0.004, "batch_size": 12.0}}
        second = poller.poll(first)
        (view,) = second.models
        assert view.rates["requests_per_s"] is not None and view.rates["requests_per_s"] > 0
        assert view.rates["mean_batch_size"] == 10.0
        server.is_up = False
        away = poller.poll(second)
        assert away.error is not None and "refused" in away.error
        assert away.models == second.models  # the last figures stay on screen
        server.is_up = True
        back = poller.poll(away)
        assert back.error is None
        (view,) = back.models
        assert view.rates["requests_per_s"] is None  # counters may have restarted
