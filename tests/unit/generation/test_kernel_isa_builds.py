"""The C++ kernels built for CPUs other than this one: the same tests pass on the builds a
machine without AVX-512 (``-march=haswell``: AVX2), with SSE2 only (``-march=x86-64``), or
with the vector paths off (``CARPOOL_NO_VECTOR``, the plain loops a compiler without GCC's
vector extension takes) would make. Each build runs in a child process of its own (its
ops would clash with this process's) with its own extension directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CHILD = """
import sys
import pytest
from carpool.generation import paged_decode as pd
flags = sys.argv[1].split()
pd.CFLAGS = tuple(f for f in pd.CFLAGS if not f.startswith("-march")) + tuple(flags)
build = pd.load_kernel()
if not build.is_available:
    print("BUILD FAILED:", build.reason)
    sys.exit(3)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    found = {
        word for line in text.splitlines() if line.startswith("flags") for word in line.split()
    }
    return all(flag in found for flag in flags)


VARIANTS = [
    pytest.param("-march=x86-64", id="sse2"),
    pytest.param("-march=native -DCARPOOL_NO_VECTOR", id="no-vector"),
    pytest.param(
        "-march=haswell",
        id="avx2",
        marks=pytest.mark.skipif(
            not _cpu_has("avx2", "fma"), reason="this CPU cannot run AVX2 code"
        ),
    ),
]


@pytest.mark.parametrize("flags", VARIANTS)
def test_the_kernels_pass_their_tests_built_for_another_cpu(flags: str, tmp_path: Path) -> None:
    tests = [
        str(HERE / "test_packed_linear.py"),
        str(HERE / "test_paged_decode.py"),
        str(HERE / "test_fused_ops.py"),
        "-k",
        "equals or refuses or threads",
    ]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, flags, *tests],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
