"""The load generator's engine: when requests go out, how they are timed, what they add up to.

Two ways to load a server:

* **open loop** — requests are sent at *scheduled* times drawn up front from an arrival
  process (constant, Poisson, gamma, a piecewise rate schedule, or a replayed trace),
  whatever the server does meanwhile. Latency counts from the scheduled time, not from
  when the request actually left: a client that falls behind (a stalled server holding
  every connection, a saturated CPU) cannot hide the wait it caused ("coordinated
  omission"). A send that starts more than ``BEHIND_SCHEDULE_S`` late is counted as
  *behind schedule*, and the largest lag is reported, so the client admits when it could
  not keep up.
* **closed loop** — N workers, each sending its next request when the previous answers.
  A request is scheduled the moment its worker is free, so lag is zero by construction.

Every arrival process is a unit-rate process warped through the cumulative rate::

    Λ(t) = ∫₀ᵗ rate(s) ds        unit arrivals u₁ < u₂ < ...   →   tₖ = Λ⁻¹(uₖ)

so a schedule of rates keeps the shape (regular, Poisson, bursty gamma) of its gaps.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import itertools
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from carpool.core.clock import Clock, MonotonicClock
from carpool.errors import ConfigError

BEHIND_SCHEDULE_S = 0.001
_WAKE_EARLY_S = 0.001  # event-loop timers are ~1 ms coarse: wake early, then yield until due
_YIELD_EVERY = 64  # a dispatcher that is behind still lets replies in every so often
TIMEOUT = "timeout"
RECENT_LATENCIES = 2000  # how many latest latencies Progress keeps for a live display

Times = npt.NDArray[np.float64]


class Arrival(enum.Enum):
    """The shape of the gaps between scheduled sends."""

    CONSTANT = "constant"
    POISSON = "poisson"
    GAMMA = "gamma"


@dataclass(frozen=True, slots=True)
class RateStep:
    """From ``start_s`` on (until the next step) requests arrive at ``rate_rps``."""

    start_s: float
    rate_rps: float


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    """Scheduled send times: gaps shaped by ``arrival``, rate given by ``steps``.

    ``burstiness`` is the squared coefficient of variation (CV²) of the gamma gaps: 1 is
    Poisson, above 1 bursty, below 1 more regular than Poisson.
    """

    arrival: Arrival
    steps: tuple[RateStep, ...]
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not self.steps or self.steps[0].start_s != 0.0:
            raise ConfigError("schedule", self.steps, "steps starting at 0 s")
        starts = [step.start_s for step in self.steps]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ConfigError("schedule", starts, "step start times that increase")
        rates = [step.rate_rps for step in self.steps]
        if any(not math.isfinite(r) or r < 0 for r in rates) or max(rates) <= 0:
            raise ConfigError("rate", rates, "finite rates >= 0 req/s, at least one above 0")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ConfigError("burstiness", self.burstiness, "a CV² above 0 (1 is Poisson)")

    @classmethod
    def steady(cls, rate_rps: float, arrival: Arrival, burstiness: float = 1.0) -> ArrivalProcess:
        return cls(arrival, (RateStep(0.0, rate_rps),), burstiness)

    def send_times(self, duration_s: float, rng: np.random.Generator) -> Times:
        """Scheduled send offsets in [0, ``duration_s``), increasing, in seconds."""
        starts = np.array([s.start_s for s in self.steps if s.start_s < duration_s])
        rates = np.array([s.rate_rps for s in self.steps][: len(starts)])
        ends = np.append(starts[1:], duration_s)
        cumulative = np.concatenate([[0.0], np.cumsum(rates * (ends - starts))])
        total = float(cumulative[-1])
        units = self._unit_arrivals(total, rng)
        # The segment each unit arrival falls in; a zero-rate segment shares its Λ with the
        # next, so side="right" always lands on a segment whose rate is above zero.
        segment = np.searchsorted(cumulative[:-1], units, side="right") - 1
        times: Times = starts[segment] + (units - cumulative[segment]) / rates[segment]
        return times

    def _unit_arrivals(self, total: float, rng: np.random.Generator) -> Times:
        if self.arrival is Arrival.CONSTANT:
            return np.arange(math.ceil(total), dtype=np.float64)
        chunks: list[Times] = []
        reached = 0.0
        while reached < total:
            size = max(16, int((total - reached) * 1.1) + 16)
            if self.arrival is Arrival.POISSON:
                gaps = rng.exponential(1.0, size)
            else:
                cv2 = self.burstiness
                gaps = rng.gamma(1.0 / cv2, cv2, size)
            chunk = reached + np.cumsum(gaps)
            chunks.append(chunk)
            reached = float(chunk[-1])
        units = np.concatenate(chunks)
        kept: Times = units[units < total]
        return kept


def read_trace(path: str | Path) -> Times:
    """Send offsets replayed from ``path``: one float (seconds) per line; blank lines and
    ``#`` comments skipped; returned sorted.

    Raises:
        ConfigError: the file cannot be read, a line is not a number >= 0, or none is left.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConfigError("trace", str(path), f"a readable file ({error.strerror})") from None
    values: list[float] = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"trace line {number}", text, "seconds >= 0", file=str(path))
        values.append(value)
    if not values:
        raise ConfigError("trace", str(path), "at least one send time", file=str(path))
    return np.sort(np.array(values, dtype=np.float64))


_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ms|s|m|h)?\s*")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str, name: str = "duration") -> float:
    """``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or plain seconds (``"1.5"``) in seconds."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ConfigError(name, text, "a duration such as 10s, 500ms, 2m or 1.5")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def parse_schedule(text: str) -> tuple[RateStep, ...]:
    """``"0:50,10s:200,20s:50"`` (start:rate pairs, starts as durations) as rate steps."""
    steps: list[RateStep] = []
    for part in text.split(","):
        start, sep, rate = part.partition(":")
        try:
            rate_rps = float(rate)
        except ValueError:
            rate_rps = math.nan
        if not sep or not math.isfinite(rate_rps):
            raise ConfigError("schedule", text, "start:rate pairs such as 0:50,10s:200,20s:50")
        steps.append(RateStep(parse_duration(start, "schedule"), rate_rps))
    return tuple(steps)


# ---------------------------------------------------------------------------------------
# Requests and targets


@dataclass(slots=True)
class RequestRecord:
    """One request. Times are clock seconds; the target fills everything after
    ``scheduled_s`` except ``done_s``, which the generator stamps."""

    index: int
    scheduled_s: float
    sent_s: float = math.nan
    done_s: float = math.nan
    status: int = 0  # HTTP status; 0 when there is none (in-process, transport error)
    error: str | None = None  # None when the request succeeded
    num_items: int = 0
    num_tokens: int = 0
    first_token_s: float | None = None  # streams: when the first token arrived
    itl_s: list[float] | None = None  # streams: gaps between consecutive tokens

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.done_s - self.scheduled_s

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s


class Target(Protocol):
    """Something to load: opened once, called once per request, closed at the end."""

    description: str

    async def open(self) -> None: ...

    async def call(self, record: RequestRecord) -> None:
        """Send one request: set ``sent_s`` when it leaves, then its outcome (``status``,
        ``error``, ``num_items``, tokens). May raise; the generator records the error."""

    async def close(self) -> None: ...


class Mode(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RunResult:
    """One measured run: its records and the clock reading it started at."""

    mode: Mode
    records: list[RequestRecord]
    started_s: float
    duration_s: float  # the scheduled (open) or configured (closed) sending time
    concurrency: int | None = None
    offered_rate_rps: float | None = None


@dataclass(slots=True)
class Progress:
    """Live counts a display may read while a run goes on."""

    num_sent: int = 0
    num_done: int = 0
    num_errors: int = 0
    # The latest latencies only (what the live line's p50 reads): a long run at a high
    # rate must not keep one float per request for the display.
    recent_latency_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_LATENCIES)
    )


class LoadGenerator:
    """Drives a :class:`Target` open- or closed-loop and keeps every request's record.

    Requests still unanswered ``drain_timeout_s`` after sending ends count as errors
    (``"timeout"``) and are cancelled.
    """

    def __init__(
        self, target: Target, *, clock: Clock | None = None, drain_timeout_s: float = 30.0
    ) -> None:
        self._target = target
        self._clock = clock or MonotonicClock()
        self._drain_timeout_s = drain_timeout_s
        self.progress = Progress()

    async def run_open(
        self, send_times_s: Sequence[float] | Times, duration_s: float | None = None
    ) -> RunResult:
        """Send at ``start + offset`` for each offset, whatever the answers do.

        ``duration_s`` is the window the offsets were drawn for: the offered rate is the
        scheduled sends over it (without it, over the last offset, which overstates a
        short run: 5 sends 10 ms apart are 100 req/s over 50 ms, not 125 over 40 ms).
        """
        clock = self._clock
        offsets = [float(t) for t in send_times_s]
        records: list[RequestRecord] = []
        senders = _Senders(self._one)
        started_s = clock.now()
        since_yield = 0
        for index, offset in enumerate(offsets):
            when = started_s + offset
            if when > clock.now():
                await self._sleep_until(when)
                since_yield = 0
            elif (since_yield := since_yield + 1) >= _YIELD_EVERY:
                await asyncio.sleep(0)
                since_yield = 0
            record = RequestRecord(index, when)
            records.append(record)
            senders.submit(record)
        await self._drain(senders.close(), records)
        if duration_s is None:
            duration_s = offsets[-1] if offsets else 0.0
        rate = len(offsets) / duration_s if duration_s > 0 else None
        return RunResult(Mode.OPEN, records, started_s, duration_s, offered_rate_rps=rate)

    async def run_closed(self, concurrency: int, duration_s: float) -> RunResult:
        """``concurrency`` workers send back to back for ``duration_s``."""
        if concurrency < 1:
            raise ConfigError("concurrency", concurrency, "an integer >= 1")
        clock = self._clock
        records: list[RequestRecord] = []
        started_s = clock.now()
        stop_s = started_s + duration_s

        async def worker() -> None:
            while (now := clock.now()) < stop_s:
                record = RequestRecord(len(records), now)
                records.append(record)
                await self._one(record)

        loop = asyncio.get_running_loop()
        workers = {loop.create_task(worker()) for _ in range(concurrency)}
        await self._drain(workers, records, sending_s=duration_s)
        return RunResult(Mode.CLOSED, records, started_s, duration_s, concurrency=concurrency)

    async def _one(self, record: RequestRecord) -> None:
        progress = self.progress
        progress.num_sent += 1
        try:
            await self._target.call(record)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a failed request is a result, not a crash
            record.error = (
                f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            )
        record.done_s = now = self._clock.now()
        if math.isnan(record.sent_s):
            record.sent_s = record.scheduled_s
        progress.num_done += 1
        if record.error is None:
            progress.recent_latency_s.append(now - record.scheduled_s)
        else:
            progress.num_errors += 1

    async def _sleep_until(self, when_s: float) -> None:
        clock = self._clock
        while (delay := when_s - clock.now()) > 0:
            if delay > _WAKE_EARLY_S:
                woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                clock.call_at(when_s - _WAKE_EARLY_S, functools.partial(_wake, woken))
                await woken
            else:
                await asyncio.sleep(0)

    async def _drain(
        self, tasks: set[asyncio.Task[None]], records: list[RequestRecord], sending_s: float = 0.0
    ) -> None:
        """Waits for ``tasks`` (at most ``sending_s`` + the drain timeout), then cancels the
        rest and marks every unanswered request as timed out."""
        if tasks:
            expired = asyncio.get_running_loop().create_future()
            handle = self._clock.call_at(
                self._clock.now() + sending_s + self._drain_timeout_s, lambda: _wake(expired)
            )
            everything = asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.wait([everything, expired], return_when=asyncio.FIRST_COMPLETED)
            handle.cancel()
            expired.cancel()
            if not everything.done():
                for task in tasks:
                    task.cancel()
                await asyncio.gather(everything, return_exceptions=True)
        for record in records:
            if math.isnan(record.done_s):
                record.error = TIMEOUT
                self.progress.num_errors += 1


class _Senders:
    """Coroutines that send due records, reused from one request to the next.

    A task per request would cost its creation and registration every time; here a new
    sender starts only when every existing one is busy, so their number follows the
    requests in flight and the steady state creates nothing.
    """

    def __init__(self, send: Callable[[RequestRecord], Awaitable[None]]) -> None:
        self._send = send
        self._due: collections.deque[RequestRecord] = collections.deque()
        self._idle: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._is_closing = False

    def submit(self, record: RequestRecord) -> None:
        self._due.append(record)
        if self._idle:
            _wake(self._idle.pop())
        else:
            self._tasks.add(asyncio.get_running_loop().create_task(self._run()))

    def close(self) -> set[asyncio.Task[None]]:
        """No more records: idle senders end, busy ones end once the queue is empty."""
        self._is_closing = True
        while self._idle:
            _wake(self._idle.pop())
        return self._tasks

    async def _run(self) -> None:
        due, send = self._due, self._send
        loop = asyncio.get_running_loop()
        while True:
            while due:
                await send(due.popleft())
            if self._is_closing:
                return
            parked: asyncio.Future[None] = loop.create_future()
            self._idle.append(parked)
            await parked


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
