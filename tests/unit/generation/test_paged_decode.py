"""The C++ kernels (``paged_decode``, ``paged_prefill``): equal to the gather + SDPA path and
to attention written out by hand, the ``decode_attention`` setting (auto | kernel | torch)
and its fallback when the build fails, and greedy generation unchanged by the path."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from carpool.config import ModelConfig
from carpool.errors import ConfigError
from carpool.generation import paged_decode
from carpool.generation.attention import PagedAttention, plan_attention
from carpool.generation.paged_decode import KernelBuild, load_kernel, use_decode_kernel
from carpool.generation.runner import ModelRunner
from carpool.generation.weights import load_model
from carpool.server.builder import generation_settings

from .paged_driver import MAX_NEW, generate

BLOCK_SIZE = 16
CPU = torch.device("cpu")
# (query heads, KV heads): MHA, GQA, and one KV head for several (the scalar loop's scratch
# holds a block's scores per query head of the group)
HEADS = [(4, 4), (12, 4), (8, 2), (4, 1)]


@pytest.fixture(scope="session")
def kernel_build() -> KernelBuild:
    """The kernel, built (or its cached build loaded) once for the session."""
    started = time.perf_counter()
    build = load_kernel()
    assert build.is_available, build.reason
    print(f"paged decode kernel: ready in {time.perf_counter() - started:.1f} s")
    return build


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query [heads, D] over its own keys [L, kv_heads, D], written out by hand."""
    repeat = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(repeat, dim=1)
    v = values.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def _contexts(n: int, generator: torch.Generator) -> list[int]:
    """``n`` context lengths: 1, around block boundaries, then random up to 300."""
    edges = [1, 2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 3]
    randoms = torch.randint(1, 300, (max(0, n - len(edges)),), generator=generator).tolist()
    return (edges + randoms)[:n]


def _step(
    contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A cache with each sequence's blocks shuffled, and one decode token per sequence:
    (kv_cache, block table, slots of the new tokens, query, each one's block ids)."""
    generator = torch.Generator().manual_seed(len(contexts) * 100 + num_heads + head_dim)
    shape = (BLOCK_SIZE, num_kv_heads, head_dim)
    used = [-(-c // BLOCK_SIZE) for c in contexts]
    num_blocks = sum(used) + 1
    kv_cache = torch.randn(1, 2, num_blocks, *shape, generator=generator, dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=generator).tolist()
    blocks, start = [], 0
    for count in used:
        blocks.append(order[start : start + count])
        start += count
    width = max(used) + 2  # a table wider than any sequence needs, padded with the spare
    table = torch.tensor([b + [num_blocks - 1] * (width - len(b)) for b in blocks])
    last = [c - 1 for c in contexts]
    slots = torch.tensor([b[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for b, p in zip(blocks, last, strict=True)])  # fmt: skip
    q = torch.randn(len(contexts), num_heads, head_dim, generator=generator, dtype=dtype)
    return kv_cache, table, slots, q, blocks


def _attend(
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    contexts: list[int],
    *,
    use_kernel: bool,
) -> torch.Tensor:
    """The step through ``PagedAttention``, its new K/V the values already in their slots
    (so both paths see the same cache)."""
    k = kv_cache[0, 0].flatten(0, 1)[slots]
    v = kv_cache[0, 1].flatten(0, 1)[slots]
    starts = [c - 1 for c in contexts]
    plan = plan_attention(table, [1] * len(contexts), starts, BLOCK_SIZE, use_kernel=use_kernel)
    assert (plan.kernel_decode is not None) == use_kernel
    return PagedAttention(kv_cache, slots, plan)(0, q, k, v)


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 12])  # the vector path, and the plain loop
def test_kernel_equals_the_gather_path_and_a_reference(
    kernel_build: KernelBuild, n: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    contexts = _contexts(n, torch.Generator().manual_seed(n))
    kv_cache, table, slots, q, blocks = _step(
        contexts, num_heads, num_kv_heads, head_dim, torch.float32
    )
    kernel = _attend(kv_cache, table, slots, q, contexts, use_kernel=True)
    gathered = _attend(kv_cache, table, slots, q, contexts, use_kernel=False)
    torch.testing.assert_close(kernel, gathered, rtol=0, atol=1e-5)
    for i, context in enumerate(contexts):
        keys = kv_cache[0, 0, blocks[i]].flatten(0, 1)[:context]
        values = kv_cache[0, 1, blocks[i]].flatten(0, 1)[:context]
        torch.testing.assert_close(kernel[i], _reference(q[i], keys, values), rtol=0, atol=1e-5)


def test_kernel_in_float64_equals_the_reference(kernel_build: KernelBuild) -> None:
    contexts = _contexts(9, torch.Generator().manual_seed(1))
    kv_cache, table, slots, q, _ = _step(contexts, 6, 2, 64, torch.float64)
    kernel = _attend(kv_cache, table, slots, q, contexts, use_kernel=True)
    gathered = _attend(kv_cache, table, slots, q, contexts, use_kernel=False)
    torch.testing.assert_close(kernel, gathered, rtol=0, atol=1e-12)


def test_kernel_keeps_the_softmax_stable_for_large_scores(kernel_build: KernelBuild) -> None:
    contexts = [40, 3]
    kv_cache, table, slots, q, _ = _step(contexts, 4, 2, 64, torch.float32)
    q = q * 300  # scores in the thousands: exp would overflow without the running max
    kernel = _attend(kv_cache, table, slots, q, contexts, use_kernel=True)
    gathered = _attend(kv_cache, table, slots, q, contexts, use_kernel=False)
    assert torch.isfinite(kernel).all()
    torch.testing.assert_close(kernel, gathered, rtol=1e-5, atol=1e-4)


def test_decode_rows_beside_a_prefill_chunk_go_to_their_rows(kernel_build: KernelBuild) -> None:
    """A step of [decode, prefill of 3, decode]: the kernel's rows are 0 and 4."""
    generator = torch.Generator().manual_seed(3)
    kv_heads, heads, dim = 2, 4, 64
    kv_cache = torch.randn(1, 2, 12, BLOCK_SIZE, kv_heads, dim, generator=generator)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    num_tokens, starts = [1, 3, 1], [20, 30, 47]
    positions = [20, 30, 31, 32, 47]
    rows_of = [0, 1, 1, 1, 2]
    slots = torch.tensor([int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for r, p in zip(rows_of, positions, strict=True)])  # fmt: skip
    q = torch.randn(5, heads, dim, generator=generator)
    k = torch.randn(5, kv_heads, dim, generator=generator)
    v = torch.randn(5, kv_heads, dim, generator=generator)
    outs = []
    for use_kernel in (True, False):
        cache = kv_cache.clone()
        plan = plan_attention(table, num_tokens, starts, BLOCK_SIZE, use_kernel=use_kernel)
        outs.append(PagedAttention(cache, slots, plan)(0, q, k, v))
    kernel_plan = plan_attention(table, num_tokens, starts, BLOCK_SIZE, use_kernel=True)
    assert kernel_plan.kernel_decode is not None
    assert kernel_plan.kernel_decode.rows is not None
    assert kernel_plan.kernel_decode.rows.tolist() == [0, 4]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)


def test_kernel_refuses_a_block_id_outside_the_cache(kernel_build: KernelBuild) -> None:
    kv_cache, table, _, q, _ = _step([20], 4, 2, 64, torch.float32)
    table[0, 1] = 999
    with pytest.raises(RuntimeError, match="block 1 is 999, expected 0 to"):
        paged_decode.paged_decode(q, kv_cache[0, 0], kv_cache[0, 1], table, torch.tensor([20]), 1.0)


def test_kernel_refuses_a_context_longer_than_its_table(kernel_build: KernelBuild) -> None:
    kv_cache, table, _, q, _ = _step([20], 4, 2, 64, torch.float32)
    too_long = torch.tensor([table.shape[1] * BLOCK_SIZE + 1])
    with pytest.raises(RuntimeError, match=r"context length .*expected 1 to"):
        paged_decode.paged_decode(q, kv_cache[0, 0], kv_cache[0, 1], table, too_long, 1.0)


def _prefill(
    n: int, num_cached: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], list[int]]:
    """One chunk of ``n`` tokens after ``num_cached`` in the cache, its blocks shuffled over
    a larger cache: (kv_cache, its table row [1, columns], slots of the chunk's tokens,
    (q, k, v) of the chunk, its block ids)."""
    generator = torch.Generator().manual_seed(n * 1000 + num_cached + num_heads + head_dim)
    used = -(-(num_cached + n) // BLOCK_SIZE)
    num_blocks = used + 3
    shape = (BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache = torch.randn(1, 2, num_blocks, *shape, generator=generator, dtype=dtype)
    blocks = torch.randperm(num_blocks, generator=generator)[:used].tolist()
    table = torch.tensor([[*blocks, blocks[0]]])  # wider than the chunk needs
    slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(num_cached, num_cached + n)])  # fmt: skip
    q = torch.randn(n, num_heads, head_dim, generator=generator, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=generator, dtype=dtype)
    return kv_cache, table, slots, (q, k, v), blocks


def _attend_chunk(
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    qkv: tuple[torch.Tensor, ...],
    num_cached: int,
    *,
    use_kernel: bool,
) -> torch.Tensor:
    """The chunk through ``PagedAttention`` on a copy of the cache (it writes its K/V)."""
    n = qkv[0].shape[0]
    plan = plan_attention(table, [n], [num_cached], BLOCK_SIZE, use_kernel=use_kernel)
    assert plan.kernel_prefill == use_kernel
    return PagedAttention(kv_cache.clone(), slots, plan)(0, *qkv)


CHUNKS = [(2, 0), (17, 0), (70, 0), (33, 5), (16, 16), (40, 300)]  # (tokens, cached before)


@pytest.mark.parametrize(("n", "num_cached"), CHUNKS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("head_dim", [32, 64, 12])  # the vector path twice, the plain loop
def test_prefill_kernel_equals_the_torch_path_and_a_reference(
    kernel_build: KernelBuild,
    n: int,
    num_cached: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    kv_cache, table, slots, qkv, blocks = _prefill(
        n, num_cached, num_heads, num_kv_heads, head_dim, torch.float32
    )
    kernel = _attend_chunk(kv_cache, table, slots, qkv, num_cached, use_kernel=True)
    torch_path = _attend_chunk(kv_cache, table, slots, qkv, num_cached, use_kernel=False)
    torch.testing.assert_close(kernel, torch_path, rtol=0, atol=1e-5)
    written = kv_cache.clone()
    for part, new in ((0, qkv[1]), (1, qkv[2])):
        written[0, part].flatten(0, 1)[slots] = new
    keys = written[0, 0, blocks].flatten(0, 1)
    values = written[0, 1, blocks].flatten(0, 1)
    for i in (0, n // 2, n - 1):  # the query at position p sees keys 0 .. p
        position = num_cached + i
        expected = _reference(qkv[0][i], keys[: position + 1], values[: position + 1])
        torch.testing.assert_close(kernel[i], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 12, 100])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 32), (4, 1, 128)])
def test_both_kernels_take_a_block_size_that_is_not_a_power_of_two(
    kernel_build: KernelBuild, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Spans of whole blocks and vectors of 8 or 16 keys: blocks that split neither."""
    generator = torch.Generator().manual_seed(block_size + head_dim)
    n, num_cached = 40, 123
    num_blocks = -(-(n + num_cached) // block_size)
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_blocks = torch.randn(*shape, generator=generator)
    v_blocks = torch.randn(*shape, generator=generator)
    ids = torch.randperm(num_blocks + 2, generator=generator)[:num_blocks]
    q = torch.randn(n, num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    prefill = paged_decode.paged_prefill(q, k_blocks, v_blocks, ids, num_cached, scale)
    keys = k_blocks[ids].flatten(0, 1)
    values = v_blocks[ids].flatten(0, 1)
    for i in (0, n - 1):
        position = num_cached + i
        expected = _reference(q[i], keys[: position + 1], values[: position + 1])
        torch.testing.assert_close(prefill[i], expected, rtol=0, atol=1e-5)
    lengths = torch.tensor([num_cached + n])
    decode = paged_decode.paged_decode(q[-1:], k_blocks, v_blocks, ids[None], lengths, scale)
    torch.testing.assert_close(decode, prefill[-1:], rtol=0, atol=1e-5)


def test_prefill_kernel_in_float64_and_with_large_scores(kernel_build: KernelBuild) -> None:
    kv_cache, table, slots, qkv, _ = _prefill(37, 21, 8, 2, 64, torch.float64)
    kernel = _attend_chunk(kv_cache, table, slots, qkv, 21, use_kernel=True)
    torch_path = _attend_chunk(kv_cache, table, slots, qkv, 21, use_kernel=False)
    torch.testing.assert_close(kernel, torch_path, rtol=0, atol=1e-12)
    kv_cache, table, slots, (q, k, v), _ = _prefill(50, 30, 4, 2, 32, torch.float32)
    loud = (q * 300, k, v)  # scores in the thousands: exp would overflow without the max
    kernel = _attend_chunk(kv_cache, table, slots, loud, 30, use_kernel=True)
    torch_path = _attend_chunk(kv_cache, table, slots, loud, 30, use_kernel=False)
    exact = _attend_chunk(
        kv_cache.double(), table, slots, tuple(x.double() for x in loud), 30, use_kernel=False
    )
    assert torch.isfinite(kernel).all()
    # Scores this large lose digits in float32 whatever the order of the sums: the kernel
    # is held to the torch path's own distance from float64, not to the torch path.
    kernel_error = (kernel.double() - exact).abs().max().item()
    torch_error = (torch_path.double() - exact).abs().max().item()
    assert kernel_error <= max(2 * torch_error, 1e-5), (kernel_error, torch_error)


def test_prefill_kernel_on_two_threads_equals_one_thread(kernel_build: KernelBuild) -> None:
    kv_cache, table, slots, qkv, _ = _prefill(100, 60, 12, 4, 64, torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            outs.append(_attend_chunk(kv_cache, table, slots, qkv, 60, use_kernel=True))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_prefill_kernel_refuses_too_few_blocks_and_a_block_outside_the_cache(
    kernel_build: KernelBuild,
) -> None:
    kv_cache, table, _, (q, _, _), _ = _prefill(20, 20, 4, 2, 64, torch.float32)
    k_blocks, v_blocks = kv_cache[0, 0], kv_cache[0, 1]
    with pytest.raises(RuntimeError, match="40 positions need 3 blocks, block_ids has 2"):
        paged_decode.paged_prefill(q, k_blocks, v_blocks, table[0, :2], 20, 1.0)
    ids = table[0].clone()
    ids[1] = 999
    with pytest.raises(RuntimeError, match="block 1 is 999, expected 0 to"):
        paged_decode.paged_prefill(q, k_blocks, v_blocks, ids, 20, 1.0)


@pytest.fixture
def failing_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process where the kernel has not been built yet and its build fails."""

    def fail(openmp: bool = True) -> None:
        raise RuntimeError("Error building extension 'carpool_paged_decode': g++ not found")

    monkeypatch.setattr(paged_decode, "_build", fail)
    monkeypatch.setattr(paged_decode, "_build_result", None)
    monkeypatch.setattr(paged_decode, "_warned", False)


def test_a_build_left_by_a_killed_process_does_not_hold_the_next_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch marks a build in progress with a ``lock`` file and waits while one exists; a
    process killed mid-build leaves it behind. The next build removes it (it holds the
    flock every carpool build holds) and builds in carpool's own directory."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = paged_decode.build_directory()
    assert directory == tmp_path / "carpool" / paged_decode.build_name()
    (directory / paged_decode.TORCH_BUILD_MARKER).touch()  # a killed build's
    built: list[str] = []

    def load(**kwargs: Any) -> None:
        assert not (Path(kwargs["build_directory"]) / paged_decode.TORCH_BUILD_MARKER).exists()
        built.append(kwargs["build_directory"])

    monkeypatch.setattr(cpp_extension, "load", load)
    paged_decode._build()
    assert built == [str(directory)]


def test_the_kernels_run_on_torchs_openmp_runtime_and_no_second_one(
    kernel_build: KernelBuild,
) -> None:
    assert kernel_build.openmp  # at::parallel_for compiled as a parallel loop
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this system: the runtimes loaded cannot be listed")
    # What the extension links is libgomp.so.1 by that name (a wheel's renamed copy, like
    # scikit-learn's libgomp-<hash>.so, is that library's own and loaded for it alone).
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    runtimes = {path for path in paths if Path(path).name.startswith("libgomp.so")}
    assert len(runtimes) == 1, runtimes  # torch's: the kernels' libgomp.so.1 is the same


def test_a_compiler_without_openmp_still_builds_the_kernels_for_one_thread(
    kernel_build: KernelBuild, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tried: list[bool] = []

    def build(openmp: bool = True) -> None:  # the ops stay registered from the real build
        tried.append(openmp)
        if openmp:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")

    monkeypatch.setattr(paged_decode, "_build", build)
    monkeypatch.setattr(paged_decode, "_build_result", None)
    with caplog.at_level(logging.INFO, logger=paged_decode.__name__):
        result = load_kernel()
    assert tried == [True, False]
    assert result.is_available and not result.openmp
    assert "no OpenMP build" in caplog.text and "unsupported option '-fopenmp'" in caplog.text


def test_each_checkout_builds_its_own_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copy = tmp_path / "csrc"
    copy.mkdir()
    for path in (*paged_decode.SOURCE_PATHS, *paged_decode.HEADER_PATHS):
        (copy / path.name).write_bytes(path.read_bytes())
    here = paged_decode.build_name()
    monkeypatch.setattr(paged_decode, "CSRC", copy)
    assert paged_decode.build_name() != here  # same sources, another path


def test_auto_falls_back_to_torch_with_one_warning_when_the_build_fails(
    failing_build: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=paged_decode.__name__):
        assert not use_decode_kernel("auto", CPU, torch.float32)
        assert not use_decode_kernel("auto", CPU, torch.float32)
    (record,) = caplog.records
    assert "gather + SDPA" in record.getMessage() and "g++ not found" in record.getMessage()


def test_kernel_mode_is_a_config_error_naming_why_when_the_build_fails(
    failing_build: None,
) -> None:
    with pytest.raises(ConfigError, match=r"decode_attention.*did not build.*g\+\+ not found"):
        use_decode_kernel("kernel", CPU, torch.float32)


def test_torch_mode_neither_builds_nor_uses_the_kernel(failing_build: None) -> None:
    assert not use_decode_kernel("torch", CPU, torch.float32)
    assert paged_decode._build_result is None  # nothing was built


def test_a_dtype_the_kernel_lacks_takes_torch_under_auto_and_is_refused_under_kernel(
    failing_build: None,
) -> None:
    assert not use_decode_kernel("auto", CPU, torch.bfloat16)
    assert paged_decode._build_result is None
    with pytest.raises(ConfigError, match="float32/float64 on the CPU"):
        use_decode_kernel("kernel", CPU, torch.bfloat16)


def test_an_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"one of \['auto', 'kernel', 'torch'\]"):
        use_decode_kernel("fast", CPU, torch.float32)


def test_the_config_key_becomes_the_engine_setting() -> None:
    entry: dict[str, Any] = {"name": "g", "kind": "generation", "source": "/x"}
    model = ModelConfig.model_validate({**entry, "decode_attention": "torch"})
    assert generation_settings(model).decode_attention == "torch"
    assert generation_settings(ModelConfig.model_validate(entry)).decode_attention == "auto"
    with pytest.raises(pydantic.ValidationError, match="decode_attention"):
        ModelConfig.model_validate({**entry, "decode_attention": "fast"})


LLAMA: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 32: the kernel's vector path
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,  # larger than the default: greedy outputs vary more
}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(HFLlamaConfig(**LLAMA)).eval().save_pretrained(path)
    return path


def test_greedy_generation_is_the_same_with_kernel_and_torch_and_transformers(
    kernel_build: KernelBuild, llama_folder: Path
) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE - 1, 1, 40]
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]
    outputs = {}
    for mode in ("kernel", "torch"):
        runner = ModelRunner(load_model(llama_folder), 64, BLOCK_SIZE, decode_attention=mode)
        assert runner.decode_attention_path == mode
        outputs[mode] = generate(runner, prompts, chunk_size=7, start_steps=[0, 2, 4, 5, 1])
    reference = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected.append(out[0, len(prompt) :].tolist())
    assert outputs["kernel"] == outputs["torch"] == expected


def test_kernel_on_two_threads_equals_one_thread(kernel_build: KernelBuild) -> None:
    contexts = _contexts(33, torch.Generator().manual_seed(2))
    kv_cache, table, slots, q, _ = _step(contexts, 12, 4, 64, torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            outs.append(_attend(kv_cache, table, slots, q, contexts, use_kernel=True))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
