"""Continuous (iteration-level) batching for text generation over a paged KV cache.

Three rooms, as in vLLM's v1 core: the scheduler decides *what* runs each step
(``scheduler.py``), the KV-cache manager decides *where* its K/V lives
(``kv_cache.py``), the block pool owns the blocks (``block_pool.py``). Model runners
(``runner.py``, ``llama.py``, ``gpt2.py``) read and write K/V through block tables; the
output processor (``output.py``) makes each request's text and finds its stops; the
engine (``engine.py``) steps them and streams text to each request. ``build.py`` builds
an engine from settings: nothing here imports ``carpool.server``.
"""
