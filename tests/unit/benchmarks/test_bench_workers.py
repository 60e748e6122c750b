"""bench_workers: the server's CPU read from /proc, the engine's own share apart."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench_workers import tree_cpu_ticks


def test_the_tree_counts_live_children_and_the_own_share_is_the_process_alone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.6)  # the child spins: ticks of its own
        user, system, own = tree_cpu_ticks(os.getpid())
        with open(f"/proc/{child.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        child_ticks = int(fields[11]) + int(fields[12])
    finally:
        child.kill()
        child.wait()
    assert child_ticks > 0
    assert user + system - own >= child_ticks  # ours alone are not the tree's
    with open(f"/proc/{os.getpid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    assert own <= int(fields[11]) + int(fields[12])  # read before: never more than now
