"""Bounded load from tritonclient's HTTP client, for tests that watch a server live
(carpool top, the dashboard): a few threads send small requests until told to stop, or
until each has sent its share."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import tritonclient.http as httpclient

# Two batched models (2 * INPUT0, 20 ms a batch): requests from several threads pile up
# while a batch runs, so batches hold more than one.
_MODEL = """\
  - name: {name}
    kind: python
    source: configmodels:slow_double
    inputs: [{{name: INPUT0, datatype: FP32, shape: [-1]}}]
    outputs: [{{name: OUTPUT0, datatype: FP32, shape: [-1]}}]
    max_batch_size: 8
    max_delay_s: 0.002
"""
TWO_MODELS_CONFIG = "models:\n" + "".join(_MODEL.format(name=n) for n in ("alpha", "beta"))
MAX_REQUESTS_PER_THREAD = 2000  # a bound, whatever the stop event does


def _send(url: str, models: list[str], stop: threading.Event) -> int:
    client = httpclient.InferenceServerClient(url)
    data = np.ones((1, 4), np.float32)
    sent = 0
    try:
        while not stop.is_set() and sent < MAX_REQUESTS_PER_THREAD:
            tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            client.infer(models[sent % len(models)], [tensor])
            sent += 1
    finally:
        client.close()
    return sent


class Load:
    """``num_threads`` clients sending to ``models`` in turn, from start() until stop()."""

    def __init__(self, url: str, models: list[str], num_threads: int = 8) -> None:
        self._url, self._models, self._num_threads = url, models, num_threads
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(num_threads)
        self._sent: list[Future[int]] = []

    def __enter__(self) -> Load:
        self._sent = [
            self._pool.submit(_send, self._url, self._models, self._stop)
            for _ in range(self._num_threads)
        ]
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        try:
            total = sum(f.result() for f in self._sent)
        finally:
            self._pool.shutdown()
        assert total > 0, "the load sent nothing"
