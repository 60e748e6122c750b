"""Keep Python's cyclic garbage collector off the request path, in every serving process
(the one-process server, the engine and each front-end worker of ``--workers N``)."""

from __future__ import annotations

import gc

YOUNG_GC_THRESHOLD = 100_000  # see freeze_startup_heap


def freeze_startup_heap() -> None:
    """Move what is alive now out of the collector's reach, and widen its young generation.

    Everything allocated at startup (torch, the models, their weights' Python objects)
    moves out of the collector's reach: without it the collector re-walked that heap
    every few thousand requests, 17% of the event loop's CPU under load (``perf`` on W1 at
    concurrency 256, ``docs/benchmarks.md``). And a young generation far larger than the
    container objects in-flight requests keep alive (about ten each): at the default of
    700 the collector ran every few requests at concurrency 256, walking the live ones.
    Requests free their objects by reference counting; cycles are still collected.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)
