"""Trial runners: a batched function in this process, or a model on a running server.

Both drive the same small load (:class:`LoadDriver`): closed loop (``concurrency``
callers, each sending its next request when the last is answered) or open loop (Poisson
arrivals at ``rate_rps``). It is deliberately minimal, just enough to compare configs;
``carpool bench`` is the full load generator.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from carpool.core.batcher import Batcher
from carpool.core.clock import Clock, MonotonicClock
from carpool.core.policy import BatchPolicy
from carpool.errors import ConfigError
from carpool.tools.modelref import MODEL_FORMS, ConfiguredModel, Form, ModelRef, resolve_import
from carpool.tools.tune import REBUILDS, policy_values
from carpool.tools.tune_trial import TargetRefused, TrialConfig, WindowSample

ERROR_PAUSE_S = 0.001  # a closed-loop caller's pause after a failed request
Submit = Callable[[], Awaitable[int]]  # sends one request; returns its number of items


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Closed loop with ``concurrency`` callers, or open loop at ``rate_rps`` when set."""

    concurrency: int = 64
    rate_rps: float | None = None
    max_in_flight: int = 10_000  # open loop: arrivals beyond this count as errors
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError("concurrency", self.concurrency, "an integer >= 1")
        if self.rate_rps is not None and not (self.rate_rps > 0 and math.isfinite(self.rate_rps)):
            raise ConfigError("rate_rps", self.rate_rps, "requests per second > 0")


class LoadDriver:
    """Runs ``submit`` as the spec says, recording each answer's latency."""

    def __init__(self, submit: Submit, spec: LoadSpec, *, clock: Clock | None = None) -> None:
        self._submit = submit
        self._spec = spec
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._tasks: list[asyncio.Task[None]] = []
        self._in_flight: set[asyncio.Task[bool]] = set()
        self._latencies: list[float] = []
        self._num_items = 0
        self._num_errors = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._spec.rate_rps is None:
            self._tasks = [loop.create_task(self._caller()) for _ in range(self._spec.concurrency)]
        else:
            self._tasks = [loop.create_task(self._arrivals(self._spec.rate_rps))]

    async def stop(self) -> None:
        tasks: list[asyncio.Task[Any]] = [*self._tasks, *self._in_flight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._in_flight.clear()

    def take(self) -> tuple[list[float], int, int]:
        """(latencies, items, errors) since the last take."""
        out = (self._latencies, self._num_items, self._num_errors)
        self._latencies, self._num_items, self._num_errors = [], 0, 0
        return out

    async def _one(self, scheduled_s: float | None = None) -> bool:
        """One request; its latency counts from ``scheduled_s`` (open loop: when it was
        due, so a dispatcher that falls behind cannot hide the wait), else from now."""
        start = self._clock.now() if scheduled_s is None else scheduled_s
        try:
            num_items = await self._submit()
        except Exception:  # any failed request counts, whatever the transport raised
            self._num_errors += 1
            return False
        self._latencies.append(self._clock.now() - start)
        self._num_items += num_items
        return True

    async def _caller(self) -> None:
        while True:
            if not await self._one():
                # A target that fails at once would otherwise spin without yielding the loop.
                await asyncio.sleep(ERROR_PAUSE_S)

    async def _arrivals(self, rate_rps: float) -> None:
        rng = np.random.default_rng(self._spec.seed)
        loop = asyncio.get_running_loop()
        next_s = self._clock.now()
        while True:
            next_s += float(rng.exponential(1.0 / rate_rps))
            delay = next_s - self._clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(self._in_flight) >= self._spec.max_in_flight:
                self._num_errors += 1
                continue
            task = loop.create_task(self._one(next_s))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)


async def load_window(
    driver: LoadDriver, duration_s: float, probe: Callable[[], Awaitable[tuple[int, int]]]
) -> tuple[list[float], int, int, float, float | None]:
    """Let the load run; (latencies, items, errors, elapsed, mean batch size). The answers
    counted are those that landed while the clock ran: the probe (a stats request, for a
    server) comes before the counts are reset, or what landed during it would be counted
    in a time that left it out (a server's throughput read 4-8% high)."""
    before = await probe()
    driver.take()
    start = time.perf_counter()
    await asyncio.sleep(duration_s)
    latencies, items, errors = driver.take()
    elapsed = time.perf_counter() - start
    after = await probe()
    num_batches, num_batched = after[0] - before[0], after[1] - before[1]
    return latencies, items, errors, elapsed, (num_batched / num_batches if num_batches else None)


def rss_bytes() -> int | None:
    """This process's resident memory (Linux), or ``None`` where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# What ``carpool tune`` takes in-process (see carpool.tools.modelref).
TUNE_FORMS = (*MODEL_FORMS, Form.BATCHED)


class InProcessRunner:
    """Tunes a batched model in this process, named in any form of
    :mod:`carpool.tools.modelref`: a :class:`BatchedFunction` (its policy is the base), a
    factory (taking ``device``, or no argument: a class is built once per replica), an
    ``nn.Module``, a batched function, or a model of a serve config (built as serve builds
    it, its policy the base). Policy changes go through ``set_policy``; a new replica count
    rebuilds the batcher.

    Args:
        source: ``module:attr``, or what :func:`~carpool.tools.modelref.resolve` returned.
        payload: one request's item (the batch stacks items along a new axis 0); for a
            config's model, ``{input name: item}``; for a config's embeddings model, the
            texts (a sequence of str) its requests carry in turn, one text a request,
            tokenized by the model's own tokenizer as ``carpool serve`` tokenizes them.
        load: the load to drive.
        base_policy: the policy trials change (the BatchedFunction's or the config's, else
            the default).

    Raises:
        ConfigError: when ``source`` fits none of the forms (the message lists them).
    """

    def __init__(
        self,
        source: str | ModelRef,
        payload: Any,
        load: LoadSpec,
        *,
        base_policy: BatchPolicy | None = None,
        num_replicas: int = 1,
    ) -> None:
        ref = resolve_import(source, TUNE_FORMS) if isinstance(source, str) else source
        self.source = ref.label
        self._fn: Callable[[Any], Any] | None = None
        self._factory: Callable[[str], Any] | None = None
        self._entry: ConfiguredModel | None = None
        self._texts: tuple[str, ...] | None = None
        self._items: list[Any] | None = None  # the texts' token ids, once tokenized
        if isinstance(ref, ConfiguredModel):
            ref.check_batched("tune", texts=True)
            self._entry = ref
            if ref.takes_texts:
                self._texts = tuple(payload)
                if not self._texts:
                    raise ConfigError("texts", payload, "at least one text")
            base_policy = base_policy or ref.model.policy()
            num_replicas = len(ref.model.replica_devices())
        elif ref.form is Form.BATCHED:
            self._fn = ref.obj.__wrapped__
            base_policy = base_policy or ref.obj.batcher.policy
            num_replicas = ref.obj.batcher.num_replicas
        elif ref.form is Form.CALLABLE:
            self._fn = ref.obj
        else:  # a factory or an nn.Module: one model per replica, on its device
            self._factory = ref.batched_callable
        self.base_policy = base_policy or BatchPolicy()
        self.num_replicas = num_replicas
        self._payload = payload
        self._load = load
        self._batcher: Batcher | None = None
        self._driver: LoadDriver | None = None

    def _new_batcher(
        self, policy: BatchPolicy, num_replicas: int, name: str, buffer_pool: bool | None = None
    ) -> Batcher:
        if self._entry is None:
            return Batcher(
                self._fn,
                policy,
                fn_factory=self._factory,
                num_replicas=num_replicas,
                name=name,
                buffer_pool=bool(buffer_pool),
            )
        served = self._entry.served(
            "tune", num_replicas=num_replicas, buffer_pool=buffer_pool, texts=True
        )
        if served.embeddings is not None and self._items is None:
            assert self._texts is not None, "an embeddings entry's payload is its texts"
            self._items = list(served.embeddings.encoder.tokenize(list(self._texts)))
        batcher = served.require_batcher()
        batcher.set_policy(policy)
        return batcher

    async def start_trial(self, config: TrialConfig) -> None:
        changes = config.as_dict()
        num_replicas = int(changes.pop("num_replicas", self.num_replicas))
        pool = changes.pop("buffer_pool", None)
        buffer_pool = None if pool is None else bool(pool)
        policy = self.base_policy.replace(**policy_values(changes))  # ConfigError when invalid
        batcher = self._batcher
        if (
            batcher is not None
            and batcher.num_replicas == num_replicas
            and (buffer_pool is None or (batcher.buffer_pool is not None) == buffer_pool)
        ):
            batcher.set_policy(policy)
        else:
            if batcher is not None:
                await batcher.stop()
                # A stopped batcher's models sit in reference cycles (a replica with its
                # thread and watchdog; an embeddings service with its batcher) that only
                # the cyclic collector frees: free them now, before the new ones are
                # built, or each rebuild keeps one more model until a full collection.
                # Here, not in Replica.close: the service's cycle holds its encoder too.
                self._batcher = batcher = None
                gc.collect()
            batcher = self._new_batcher(policy, num_replicas, "tune", buffer_pool)
            self._batcher = batcher
            await batcher.start()
        # Texts: each request carries the next one's token ids, in turn.
        items = itertools.cycle([self._payload] if self._items is None else self._items)
        driver = self._driver = LoadDriver(lambda: _submit_one(batcher, next(items)), self._load)
        driver.start()

    async def measure_window(self, duration_s: float) -> WindowSample:
        assert self._driver is not None and self._batcher is not None, "start_trial first"
        batcher = self._batcher

        async def probe() -> tuple[int, int]:
            batches = batcher.snapshot().batches
            return batches.num_batches, batches.num_items

        latencies, items, errors, elapsed, mean_batch = await load_window(
            self._driver, duration_s, probe
        )
        return WindowSample(
            elapsed, items, errors, np.array(latencies), mean_batch, memory_bytes=rss_bytes()
        )

    async def end_trial(self) -> None:
        if self._driver is not None:
            await self._driver.stop()
            self._driver = None

    async def close(self) -> None:
        await self.end_trial()
        if self._batcher is not None:
            await self._batcher.stop()
            self._batcher = None

    async def sample_output(self) -> Any:
        """One item's output (to declare the model's outputs in the recommended config)."""
        batcher = self._new_batcher(self.base_policy, 1, "tune-probe")
        async with batcher:
            return await batcher.submit(self._payload if self._items is None else self._items[0])


async def _submit_one(batcher: Batcher, payload: Any) -> int:
    await batcher.submit(payload)
    return 1


class ServerRunner:
    """Tunes a model on a running carpool server through ``POST /v2/models/{m}/policy``,
    driving load with KServe v2 JSON infer requests (one row each) over httpx. ``close``
    gives the model back the policy it had at ``connect``: the recommendation goes to a
    file, never left on the server as whatever the last trial set. The server must run
    with ``--allow-policy-updates``; ``api_key``: the key it requires, if any."""

    def __init__(
        self, base_url: str, model: str, load: LoadSpec, api_key: str | None = None
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self._load = load
        # One connection more than the load's: the stats and policy requests between
        # windows must not wait for one the load's clients keep taking back (at
        # concurrency 1 the stats request never got one, and a trial never ended).
        limits = httpx.Limits(max_connections=load.concurrency + 1, max_keepalive_connections=None)
        headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, limits=limits, timeout=60.0, headers=headers
        )
        self._driver: LoadDriver | None = None
        self._body: bytes | None = None
        self.metadata: dict[str, Any] = {}
        self._starting_policy: dict[str, Any] | None = None
        self._changed: set[str] = set()  # fields the trials set, restored by close()

    def _path(self, action: str = "") -> str:
        return f"/v2/models/{self.model}" + (f"/{action}" if action else "")

    async def connect(self) -> dict[str, Any]:
        """The model's metadata; builds the infer body from its declared inputs."""
        response = await self._client.get(self._path())
        self._check_access(response)
        if response.status_code != 200:
            raise ConfigError("target", self.base_url, f"a server with model {self.model!r}")
        self.metadata = response.json()
        if self._starting_policy is None:
            self._starting_policy = await self.policy()
        inputs = []
        for spec in self.metadata["inputs"]:
            shape = [1, *(d if d > 0 else 1 for d in spec["shape"][1:])]
            data = [0.5] * math.prod(shape) if spec["datatype"] != "BYTES" else ["x"]
            inputs.append(
                {"name": spec["name"], "shape": shape, "datatype": spec["datatype"], "data": data}
            )
        self._body = orjson.dumps({"inputs": inputs})
        return self.metadata

    async def policy(self) -> dict[str, Any]:
        """The model's batch policy; a model without one (a generation model, whose
        engine schedules its requests) is a ConfigError carrying the server's reason."""
        response = await self._client.get(self._path("policy"))
        if response.status_code == 400:
            reason = response.json().get("error", "")
            raise ConfigError(
                "target",
                f"{self.base_url}{self._path()}",
                f"a model with a batch policy ({reason})",
            )
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    async def start_trial(self, config: TrialConfig) -> None:
        changes = config.as_dict()
        for name in REBUILDS:
            if name in changes:
                raise ConfigError(
                    name,
                    changes[name],
                    f"no {name} changes on a running server (tune it in-process, or restart "
                    "per value)",
                )
        if self._body is None:
            await self.connect()  # also notes the starting policy, before the first change
        document = orjson.dumps(policy_values(changes))
        response = await self._client.post(self._path("policy"), content=document)
        self._check_access(response)
        if response.status_code == 400:
            raise ConfigError("policy", changes, response.json().get("error", "a valid policy"))
        response.raise_for_status()
        # Only now changed: a refused POST changed nothing, and close() gives back only
        # what was (on a 403 it said the restore failed, of a policy never touched).
        self._changed.update(changes)
        body = self._body
        client, path = self._client, self._path("infer")
        headers = {"content-type": "application/json"}

        async def submit() -> int:
            reply = await client.post(path, content=body, headers=headers)
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            return 1

        self._driver = LoadDriver(submit, self._load)
        self._driver.start()

    async def measure_window(self, duration_s: float) -> WindowSample:
        assert self._driver is not None, "start_trial first"
        latencies, items, errors, elapsed, mean_batch = await load_window(
            self._driver, duration_s, self._stats
        )
        return WindowSample(elapsed, items, errors, np.array(latencies), mean_batch)

    def _check_access(self, response: Any) -> None:
        """A ConfigError saying what the server needs when it refused access: the API key
        (401) or policy updates (403)."""
        if response.status_code not in (401, 403):
            return
        reason = response.json().get("error", "")
        expected = (
            "a server whose API key is in CARPOOL_API_KEY"
            if response.status_code == 401
            else "a server started with 'carpool serve --allow-policy-updates', which lets "
            "carpool tune change its batch policy"
        )
        where = f"{self.base_url}{self._path()}"
        status = response.status_code
        raise TargetRefused("target", where, f"{expected} (it answered {status}: {reason})")

    async def _stats(self) -> tuple[int, int]:
        stats = (await self._client.get(self._path("stats"))).json()["model_stats"][0]
        return int(stats["execution_count"]), int(stats["inference_count"])

    async def end_trial(self) -> None:
        if self._driver is not None:
            await self._driver.stop()
            self._driver = None

    async def close(self) -> None:
        import httpx

        await self.end_trial()
        starting = self._starting_policy or {}
        restore = {name: starting[name] for name in sorted(self._changed) if name in starting}
        try:
            if restore:
                body = orjson.dumps(restore)
                answer = await self._client.post(self._path("policy"), content=body)
                if answer.status_code != 200:  # said, not hidden: the model keeps a trial's
                    print(
                        f"carpool tune: the server refused to give {self.model!r} back its "
                        f"policy {restore} ({answer.status_code}: {answer.text[:300]}); it "
                        "keeps the last trial's: set it again by hand",
                        file=sys.stderr,
                    )
        except httpx.HTTPError:
            pass  # the server went away: there is no policy left to give back
        finally:
            await self._client.aclose()
