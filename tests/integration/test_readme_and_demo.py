"""The README's example and the `make serve` demo run as a user would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_runs_and_prints_the_shapes_it_promises() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## 30 seconds", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README has a python example"
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "(16,) (16,) (3, 16)"


def test_demo_reports_what_batching_bought() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "demo", "--clients", "16", "--duration-s", "0.5"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "one at a time" in out and "carpool batching" in out
    speedup = re.search(r"batching carried ([0-9.]+)x the traffic", out)
    assert speedup is not None, out
    # Mean batch size of the batched run is reported and exceeds 1 with 16 callers.
    batched_line = next(line for line in out.splitlines() if line.startswith("carpool batching"))
    mean_batch = float(re.search(r"mean batch\s+([0-9.]+)", batched_line).group(1))  # type: ignore[union-attr]
    assert mean_batch > 1.0


def test_readme_client_examples_work_against_the_built_in_models(tmp_path: Path) -> None:
    from .conftest import start_served_process

    served = start_served_process(None, tmp_path)
    try:
        readme = (ROOT / "README.md").read_text().split("## 30 seconds", 1)[0]
        blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
        assert len(blocks) == 2, "the tritonclient and the openai examples"
        for code in blocks:
            code = code.replace("127.0.0.1:8000", served.http_url)
            code += "\nprint('ran')\n"
            if "OpenAI" in code:
                code += "assert len(vectors) == 2 and len(vectors[0].embedding) == 384\n"
            result = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
            )
            assert result.returncode == 0, result.stderr
            assert result.stdout.splitlines()[-1] == "ran"
        shown = re.findall(r"```text\n(carpool .*?)```", readme, re.S)[0].splitlines()
        said = served.output().splitlines()
        # Load-time log lines may come first (a kernel this CPU lacks, say): the banner
        # starts at its version line.
        start = next(i for i, line in enumerate(said) if line.startswith("carpool "))
        assert shown[:4] == said[start : start + 4], "the ready lines the README shows"
        # Then every line it shows, in order (the addresses differ): the malloc line
        # was missing from the README.
        expected = [line.split()[0] for line in shown]
        if served.grpc_url is None:  # this server has no gRPC port
            expected.remove("gRPC")
        heads = [line.split()[0] for line in said[start : start + len(expected)]]
        assert heads == expected, said[start:]
    finally:
        assert served.stop() == 0, served.output()
