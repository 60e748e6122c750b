"""The integration harness itself (tests/integration/conftest.py)."""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any

import tritonclient.http as httpclient


def test_a_tritonclient_http_client_collected_on_another_thread_reports_nothing() -> None:
    # A closed client left in a reference cycle, collected by a load thread's collector:
    # tritonclient's __del__ joined its gevent pool from the wrong thread and pytest
    # reported the InvalidThreadUseError against whichever test was running.
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        client = httpclient.InferenceServerClient("127.0.0.1:1")
        client.close()
        cycle: list[Any] = [client]
        cycle.append(cycle)
        del client, cycle
        collector = threading.Thread(target=gc.collect)
        collector.start()
        collector.join()
    finally:
        sys.unraisablehook = hook
    assert [type(u.exc_value).__name__ for u in unraisable] == []
