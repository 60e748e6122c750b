"""Tensors on transparent huge pages: zeros, asked for huge pages where Linux allows, plain
memory (with a reason) where it does not; the runner's KV cache and packed weights on them."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from carpool.generation import huge_pages
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SamplingParams, SeqChunk, StepInput
from carpool.generation.weights import random_llama

from .test_runner import CONFIG

BIG = (3, huge_pages.MIN_BYTES // 2 // 3 + 17)  # bfloat16: a little over one huge page


@pytest.fixture(autouse=True)
def fresh_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    huge_pages.setting.cache_clear()
    yield
    huge_pages.setting.cache_clear()


@pytest.fixture
def mappings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The mapping path taken whatever this machine's setting (sysfs read from a file that
    says ``madvise``); the sizes of the mappings made, in order."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("not Linux: no mapping is ever asked for")
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", enabled)
    sizes: list[int] = []
    real = mmap.mmap

    def spy(fileno: int, length: int, *args: object, **kwargs: object) -> mmap.mmap:
        sizes.append(length)
        return real(fileno, length, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(huge_pages.mmap, "mmap", spy)
    return sizes


def _vm_flags(tensor: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping holding ``tensor``'s first byte (/proc/self/smaps)."""
    address = tensor.data_ptr()
    flags: set[str] | None = None
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            flags = set(line.split()[1:])
    assert flags is not None, "no mapping holds the tensor"
    return flags


def _thp_available() -> bool:
    return not huge_pages.read_setting().startswith("off")


def test_zeros_are_zeros_of_the_shape_and_dtype_asked_on_an_aligned_mapping(
    mappings: list[int],
) -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        t, where = huge_pages.placed_zeros(BIG, dtype)
        assert where == "madvise" and len(mappings) == 1  # the mapping path, not torch's
        mappings.clear()
        assert t.shape == BIG and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
        assert not t.any()
        t.fill_(3)  # writable, and every element reachable
        assert t.eq(3).all()
        del t
    copy = huge_pages.copy_of(torch.arange(BIG[0] * BIG[1], dtype=torch.float32).view(BIG))
    assert len(mappings) == 1
    assert torch.equal(copy.flatten(), torch.arange(BIG[0] * BIG[1], dtype=torch.float32))


@pytest.mark.skipif(not _thp_available(), reason="this machine has no transparent huge pages")
def test_a_big_tensor_asks_for_huge_pages() -> None:
    assert "hg" in _vm_flags(huge_pages.zeros(BIG, torch.float32))
    copy = huge_pages.copy_of(torch.arange(BIG[0] * BIG[1], dtype=torch.float32).view(BIG))
    assert "hg" in _vm_flags(copy)


def test_a_small_tensor_stays_plain(mappings: list[int]) -> None:
    small = torch.ones(8, 8)
    assert huge_pages.copy_of(small) is small
    t, where = huge_pages.placed_zeros((8, 8), torch.float32)
    assert t.eq(0).all() and where == "off: 256 bytes, under one huge page"
    assert mappings == []


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch, mappings: list[int]) -> None:
    monkeypatch.setenv(huge_pages.ENV, "off")
    assert huge_pages.setting() == "off: CARPOOL_HUGE_PAGES=off"
    t, where = huge_pages.placed_zeros(BIG, torch.float32)
    assert not t.any() and where == "off: CARPOOL_HUGE_PAGES=off"
    source = torch.ones(BIG)
    assert huge_pages.copy_of(source) is source
    assert mappings == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "off: transparent huge pages are 'never'"),
    ],
)
def test_the_kernels_setting_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, expected: str
) -> None:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("not Linux: the setting is never read")
    path = tmp_path / "enabled"
    path.write_text(content)
    monkeypatch.setattr(huge_pages, "THP_ENABLED", path)
    assert huge_pages.read_setting().startswith(expected)
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "missing")
    assert huge_pages.read_setting().startswith("off: no transparent huge pages")


def test_a_refused_mapping_falls_back_with_a_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mappings: list[int]
) -> None:
    def refuse(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    with caplog.at_level(logging.INFO, logger=huge_pages.__name__):
        t, where = huge_pages.placed_zeros(BIG, torch.float32)
    assert t.shape == BIG and not t.any()
    assert where.startswith("off: the mapping was refused")
    assert "mapping was refused" in caplog.text


def test_the_runner_says_where_its_cache_lives(mappings: list[int]) -> None:
    runner = ModelRunner(random_llama(CONFIG, seed=0), num_blocks=4096, block_size=16)
    assert runner.huge_pages == "madvise"
    assert runner.kv_cache.nbytes + huge_pages.HUGE_PAGE_BYTES in mappings
    assert not runner.kv_cache.any()
    small = ModelRunner(random_llama(CONFIG, seed=0), num_blocks=4, block_size=2)
    assert small.huge_pages.startswith("off: ") and "under one huge page" in small.huge_pages


def test_packed_weights_of_a_wide_model_go_on_huge_pages(mappings: list[int]) -> None:
    wide = {**CONFIG, "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 2048}
    runner = ModelRunner(random_llama(wide, seed=0), num_blocks=64, block_size=16)
    if runner.linear_path != "carpool-packed":
        pytest.skip(f"the packed Linear kernel does not run here ({runner.linear_path})")
    # gate_up packs 2048 x 512 float32 (4 MiB): on the mapping path, and still the weight
    layer = runner.model.layers[0]
    assert layer.gate_up.packed.nbytes in [size - huge_pages.HUGE_PAGE_BYTES for size in mappings]
    x = torch.randn(3, 512)
    torch.testing.assert_close(
        layer.gate_up(x), torch.nn.functional.linear(x, layer.gate_up.weight)
    )


def _greedy_tokens(runner: ModelRunner, num_steps: int = 8) -> list[list[int]]:
    """Two sequences (prompts of 20 and 7 tokens) decoded greedily for ``num_steps``."""
    greedy = SamplingParams(temperature=0)
    prompts = [list(range(3, 23)), [7, 1, 9, 4, 4, 2, 8]]
    tables = [(0, 1), (5, 6)]
    outputs: list[list[int]] = [[], []]
    for _ in range(num_steps):
        chunks = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            new = output[-1:] or prompt  # the prompt first, then the newest token
            start = len(prompt) + len(output) - len(new)
            chunks.append(SeqChunk(i, tuple(new), start, tables[i], True, greedy))
        for i, token in enumerate(runner.execute(StepInput(tuple(chunks))).sampled):
            assert token is not None
            outputs[i].append(token)
    return outputs


def test_the_runner_without_huge_pages_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    with_pages = _greedy_tokens(ModelRunner(random_llama(CONFIG, seed=0), 4096, 16))
    monkeypatch.setenv(huge_pages.ENV, "off")
    huge_pages.setting.cache_clear()
    runner = ModelRunner(random_llama(CONFIG, seed=0), 4096, 16)
    assert runner.huge_pages.startswith("off")
    assert _greedy_tokens(runner) == with_pages
