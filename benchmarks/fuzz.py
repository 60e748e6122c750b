"""Fuzzing at campaign size: the fuzz test modules with 10,000 examples per property.

    .venv/bin/python benchmarks/fuzz.py [--examples 10000] [--modules http,grpc,socket]

Runs ``tests/integration/test_fuzz_{http,grpc,socket}.py`` under pytest with
``CARPOOL_FUZZ_EXAMPLES`` set (each module against one real `carpool serve` of the
built-in models; what each property checks is in the modules' docstrings), collects what
each module's server answered (tests/integration/fuzzing.py writes it), and records per
module: cases sent, answers by status, server errors (undocumented HTTP 5xx, gRPC
INTERNAL/UNKNOWN/DATA_LOSS, each kept with what was sent, up to 20), crashes, the
server's RSS growth since the module's warm-up, and each property's pytest outcome. A
property that fails stops at hypothesis's shrunk example: the cases counted include
the shrinking. Results go to ``benchmarks/results/fuzz.json``; the issue's targets (zero
5xx, zero crashes, RSS growth <= 50 MiB) are printed PASS/FAIL, and the exit status is 1
when one fails. Takes 15 to 20 minutes on two cores (1,000 examples: 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from benchlib import RESULTS, ROOT, machine_info, utc_now, write_results

MODULES = ("http", "grpc", "socket")
MAX_RSS_GROWTH_MIB = 50.0


def outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome from a pytest JUnit XML file: passed, failed, error or skipped."""
    if not junit.exists():
        return {}
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[case.get("name", "?")] = (
            {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
        )
    return found


def run_module(module: str, examples: int, folder: Path) -> dict[str, Any]:
    report, junit = folder / f"{module}.jsonl", folder / f"{module}.xml"
    test = ROOT / "tests" / "integration" / f"test_fuzz_{module}.py"
    env = {**os.environ, "CARPOOL_FUZZ_EXAMPLES": str(examples), "CARPOOL_FUZZ_REPORT": str(report)}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider",
         "-o", "timeout=0", f"--junitxml={junit}"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    logs = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    result: dict[str, Any] = logs[-1] if logs else {"module": f"test_fuzz_{module}"}
    result.update(
        pytest_exit_status=done.returncode,
        seconds=time.monotonic() - start,
        properties=outcomes(junit),
    )
    if done.returncode != 0:
        result["pytest_tail"] = done.stdout[-4000:]
    return result


def checks(result: dict[str, Any]) -> list[tuple[str, bool]]:
    growth_mib = result.get("rss_growth_kib", float("inf")) / 1024
    return [
        (f"server errors: {result.get('num_server_errors', '?')} (target 0)",
         result.get("num_server_errors") == 0),
        (f"crashes: {result.get('num_crashes', '?')} (target 0)", result.get("num_crashes") == 0),
        (f"RSS growth: {growth_mib:.1f} MiB (target <= {MAX_RSS_GROWTH_MIB:g})",
         growth_mib <= MAX_RSS_GROWTH_MIB),
        (f"properties: {result['properties']}", result["pytest_exit_status"] == 0),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=10_000, help="per property")
    parser.add_argument("--modules", default=",".join(MODULES))
    parser.add_argument("--json", type=Path, default=RESULTS / "fuzz.json")
    args = parser.parse_args()
    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    results = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        for module in args.modules.split(","):
            print(f"== test_fuzz_{module}: {args.examples} examples per property", flush=True)
            result = run_module(module, args.examples, Path(tmp))
            results.append(result)
            print(
                f"  {result.get('num_cases', 0)} cases in {result['seconds']:.0f} s, "
                f"answers {result.get('statuses', {})}",
                flush=True,
            )
            for line, passed in checks(result):
                print(f"  {'PASS' if passed else 'FAIL'} {line}", flush=True)
                failed |= not passed
            for error in result.get("server_errors", []):
                print(f"    {error[:300]}")
    write_results(
        args.json,
        {"when": utc_now(), "machine": machine, "examples_per_property": args.examples,
         "modules": results},
    )  # fmt: skip
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
