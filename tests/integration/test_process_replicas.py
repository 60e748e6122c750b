"""`carpool serve` with ``executor: process``: each replica in its own process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from .conftest import DOUBLER_CONFIG, StartServer, process_alive, wait_until

# The doubler, sleeping 20 ms per batch so that both replicas take batches.
CONFIG = DOUBLER_CONFIG.replace("configmodels:double", "configmodels:slow_double") + (
    "    executor: process\n    num_replicas: 2\n"
)


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found.update(int(p) for p in text.split())
    return found


def test_a_model_with_process_replicas_is_answered_over_http(start_server: StartServer) -> None:
    served = start_server(CONFIG)
    url = f"http://{served.http_url}/v2/models/doubler/infer"

    def infer(i: int) -> list[float]:
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [i, 1]}]}
        response = httpx.post(url, json=body, timeout=10)
        assert response.status_code == 200, response.text
        return list(response.json()["outputs"][0]["data"])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(infer, range(16)))
    assert results == [[2.0 * i, 2.0] for i in range(16)]
    children = _children(served.process.pid)
    assert len(children) >= 2  # the two replicas (and multiprocessing's resource tracker)
    metrics = httpx.get(f"http://{served.http_url}/metrics", timeout=5).text
    assert 'carpool_replica_restarts_total{model="doubler"} 0.0' in metrics
    for replica in ("0", "1"):  # both computed batches
        line = f'carpool_replica_busy_seconds_total{{model="doubler",replica="{replica}"}}'
        busy = [row for row in metrics.splitlines() if row.startswith(line)]
        assert busy and float(busy[0].split()[-1]) > 0, metrics
    assert served.stop() == 0, served.output()
    # multiprocessing's resource tracker ends once it reads the server's end of its pipe
    wait_until(
        lambda: not any(process_alive(pid) for pid in children), "no child of the server left"
    )
