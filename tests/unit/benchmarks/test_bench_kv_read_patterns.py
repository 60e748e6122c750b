"""bench_kv_read_patterns' read orders: each reads every float of the contexts' blocks,
K and V, once, whichever order it takes (its sums are those of the blocks)."""

from __future__ import annotations

import shutil

import pytest
import torch

from bench_kv_read_patterns import PATTERNS, build_patterns


@pytest.fixture(scope="module")
def patterns() -> object:
    if not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler for load_inline here (the benchmark times the kernel alone)")
    return build_patterns()  # with a compiler, a build error is a failure


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_each_order_reads_each_block_of_each_context_once(patterns: object, name: str) -> None:
    generator = torch.Generator().manual_seed(1)
    # small integers: float sums in any order are exact
    k = torch.randint(0, 5, (12, 16, 4, 64), generator=generator).float()
    v = torch.randint(0, 5, (12, 16, 4, 64), generator=generator).float()
    table = torch.tensor([[7, 2, 9], [4, 0, 0], [11, 3, 0]])
    lengths = torch.tensor([40, 16, 17])  # 3, 1 and 2 blocks
    used = [7, 2, 9, 4, 11, 3]
    want = float(k[used].sum() + v[used].sum())
    mode, prefetch = PATTERNS[name]
    got = patterns.read_pattern(k, v, table, lengths, mode, prefetch)  # type: ignore[attr-defined]
    assert got == want
