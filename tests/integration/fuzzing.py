"""Shared by the fuzz modules (test_fuzz_http, test_fuzz_grpc, test_fuzz_socket): one real
`carpool serve` of the built-in models per module, hypothesis's settings, JSON values to
fuzz with, and a log of what the server answered that benchmarks/fuzz.py collects.

``CARPOOL_FUZZ_EXAMPLES`` sets the examples per property (200 by default: a module runs in
well under a minute on two cores); benchmarks/fuzz.py runs 10,000. With
``CARPOOL_FUZZ_REPORT=FILE`` each module appends one JSON line to FILE as it ends: cases
sent, answers by status, undocumented 5xx (with what was sent), crashes and the server's
RSS over the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from .conftest import ServedProcess, rss_kb, start_served_process

EXAMPLES = int(os.environ.get("CARPOOL_FUZZ_EXAMPLES", "200"))
REPORT = os.environ.get("CARPOOL_FUZZ_REPORT")
MAX_RSS_GROWTH_KIB = 50 * 1024  # the bound over 10,000 cases
# The 5xx statuses carpool documents (server/errors.py): 501 for a Triton extension it
# does not implement, 503 for overload, a deadline passed in the queue, or draining.
DOCUMENTED_5XX = frozenset({501, 503})
MAX_LOGGED = 20  # undocumented answers kept with what was sent

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every run: CI stays stable
    database=None,
    suppress_health_check=list(HealthCheck),
)

MLP = "mlp"
EMBEDDINGS = "all-MiniLM-L6-v2"
GENERATION = "tiny-random-llama"
MODEL_NAMES = st.sampled_from([MLP, EMBEDDINGS, GENERATION, "no-such-model"]) | st.text(max_size=12)

# Any JSON value, ints past 64 bits included; floats finite (json.dumps writes NaN as a
# bare NaN, which some cases send on purpose, see json_text).
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@st.composite
def json_text(draw: st.DrawFn, document: Any) -> bytes:
    """``document`` as JSON bytes, sometimes spoiled: cut short, a NaN or an Infinity in
    place of the first number, or bytes that are not UTF-8 appended."""
    text = json.dumps(document).encode()
    spoil = draw(st.sampled_from(["none"] * 6 + ["cut", "nan", "bytes"]))
    if spoil == "cut" and text:
        return text[: draw(st.integers(0, len(text) - 1))]
    if spoil == "nan":
        return text.replace(b"0", b"NaN", 1).replace(b"1", b"-Infinity", 1)
    if spoil == "bytes":
        return text + draw(st.binary(min_size=1, max_size=8))
    return text


def is_http_fault(status: int) -> bool:
    """A 5xx carpool does not document: the server's fault, not the client's."""
    return 500 <= status < 600 and status not in DOCUMENTED_5XX


@dataclass
class FuzzLog:
    """What one module's fuzzing saw. A server error is an undocumented HTTP 5xx, or a
    gRPC INTERNAL, UNKNOWN or DATA_LOSS."""

    module: str
    examples_per_property: int = EXAMPLES
    num_cases: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    num_server_errors: int = 0
    server_errors: list[str] = field(default_factory=list)
    num_crashes: int = 0
    rss_start_kib: int = 0
    rss_end_kib: int = 0

    def saw(self, status: int | str, what: str, *, is_fault: bool) -> bool:
        """Counts one answer; False (and kept, with ``what``) for a server error."""
        self.num_cases += 1
        self.statuses[str(status)] += 1
        if is_fault:
            self.num_server_errors += 1
            if len(self.server_errors) < MAX_LOGGED:
                self.server_errors.append(f"{status}: {what[:500]}")
        return not is_fault

    def write(self) -> None:
        if REPORT:
            record = {**asdict(self), "statuses": dict(self.statuses)}
            record["rss_growth_kib"] = self.rss_end_kib - self.rss_start_kib
            with open(REPORT, "a", encoding="utf-8") as sink:
                sink.write(json.dumps(record) + "\n")


@dataclass
class Fuzzed:
    """A module's server and its log."""

    process: ServedProcess
    log: FuzzLog

    @property
    def url(self) -> str:
        return f"http://{self.process.http_url}"

    def rss_kib(self) -> int:
        return rss_kb(self.process.process.pid)

    def check_alive(self) -> None:
        """The server still runs and is ready (a crash is counted, then fails the test)."""
        answer = None
        if self.process.process.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(f"{self.url}/v2/health/ready", timeout=30).status_code
        if answer != 200:
            self.log.num_crashes += 1
            raise AssertionError(f"the server is gone or not ready ({answer}):\n{self.output()}")

    def output(self) -> str:
        return self.process.output()[-3000:]


def policy_update_args() -> list[str]:
    """``--allow-policy-updates`` when this carpool has it (policy changes over the network
    are turned off without it, issue 22): the policy route is fuzzed with updates on."""
    help_text = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    ).stdout
    return ["--allow-policy-updates"] if "--allow-policy-updates" in help_text else []


@contextlib.contextmanager
def fuzzed_server(folder: Path, module: str, *, grpc: bool = False) -> Iterator[Fuzzed]:
    """`carpool serve` of the built-in models (policy updates allowed when there is such a
    switch) for one module; its log is written when the module ends, and the server must
    then still stop cleanly."""
    process = start_served_process(None, folder, grpc=grpc, args=policy_update_args())
    fuzzed = Fuzzed(process, FuzzLog(module))
    try:
        yield fuzzed
    finally:
        if process.process.poll() is None:
            fuzzed.log.rss_end_kib = fuzzed.rss_kib()
        else:
            fuzzed.log.num_crashes += 1
        fuzzed.log.write()
        assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output(), process.output()


def check_memory(fuzzed: Fuzzed) -> None:
    """The server's RSS grew at most MAX_RSS_GROWTH_KIB since the module's warm-up."""
    fuzzed.check_alive()
    fuzzed.log.rss_end_kib = fuzzed.rss_kib()
    growth = fuzzed.log.rss_end_kib - fuzzed.log.rss_start_kib
    assert growth <= MAX_RSS_GROWTH_KIB, (
        f"RSS grew {growth / 1024:.1f} MiB over {fuzzed.log.num_cases} cases"
    )
