"""``carpool trace [URL] --seconds 10 --out trace.json``: record what a running server does
for a while, as a Chrome trace-event file that Perfetto (ui.perfetto.dev) opens.

It asks the server for ``GET /v2/timelines?seconds=S`` (:mod:`carpool.server.timelines`:
the server records request timelines only while asked), then writes one track per
replica with its batches as slices, and each request as a slice on a request lane with
a flow arrow to its batch (:mod:`carpool.tools.trace_events`). The API key, if the server
needs one, comes from ``CARPOOL_API_KEY``. Exit status: 0 written, 1 the server failed
or could not be reached, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from carpool.errors import CarpoolError, ConfigError
from carpool.tools.outputs import writable_path
from carpool.tools.trace_events import chrome_trace, timeline_from_dict

DEFAULT_URL = "http://127.0.0.1:8000"
MAX_SECONDS = 300.0  # the server's limit (carpool.server.timelines.MAX_CAPTURE_S)
ANSWER_GRACE_S = 30.0  # past the capture, for the answer to arrive


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="carpool trace", description="Record a running server's requests and batches."
    )
    p.add_argument(
        "url", metavar="URL", nargs="?", default=DEFAULT_URL, help=f"the server ({DEFAULT_URL})"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        help=f"how long to record (10, at most {MAX_SECONDS:g})",
    )
    p.add_argument("--out", type=Path, required=True, help="the Chrome trace-event JSON file")
    return p


def fetch_timelines(url: str, seconds: float, api_key: str | None) -> dict[str, Any]:
    """The server's ``/v2/timelines`` document after ``seconds``.

    Raises:
        httpx.HTTPError: the server could not be reached, or answered an error status.
    """
    import httpx

    headers = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
    response = httpx.get(
        f"{url.rstrip('/')}/v2/timelines",
        params={"seconds": f"{seconds:g}"},
        headers=headers,
        timeout=seconds + ANSWER_GRACE_S,
    )
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def trace_document(served: dict[str, Any], url: str) -> dict[str, Any]:
    """The Chrome trace of a ``/v2/timelines`` document."""
    timelines = [timeline_from_dict(t) for t in served["timelines"]]
    metadata = {
        "source": "carpool trace",
        "url": url,
        "seconds": served["seconds"],
        "num_requests": len(timelines),
        "num_dropped": served["num_dropped"],
        "unix_offset_s": served["unix_offset_s"],
    }
    return chrome_trace(timelines, metadata=metadata)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``carpool trace``; exits with the status the module doc lists."""
    import httpx

    from carpool.server.access import API_KEY_ENV

    args = build_parser().parse_args(argv)
    try:
        if not 0 < args.seconds <= MAX_SECONDS:
            raise ConfigError("--seconds", args.seconds, f"above 0 and at most {MAX_SECONDS:g}")
        out = writable_path("--out", args.out)
    except CarpoolError as error:
        print(f"carpool trace: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    assert out is not None
    print(f"carpool trace: recording {args.url} for {args.seconds:g} s", file=sys.stderr)
    try:
        served = fetch_timelines(args.url, args.seconds, os.environ.get(API_KEY_ENV))
    except httpx.HTTPStatusError as error:
        body = error.response.text[:500]
        print(f"carpool trace: {args.url}: {error.response.status_code} {body}", file=sys.stderr)
        raise SystemExit(1) from None
    except httpx.HTTPError as error:
        print(f"carpool trace: {args.url}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    document = trace_document(served, args.url)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document), encoding="utf-8")
    meta = document["otherData"]
    print(f"wrote {out}: {meta['num_requests']} requests ({meta['num_dropped']} dropped)")
