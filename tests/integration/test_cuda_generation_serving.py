"""`carpool serve CONFIG.yaml` generating on a CUDA GPU, through the official `openai` client.

One server holds the same random-weight Llama folder twice, ``device: cpu`` and ``device:
cuda:0``: greedy and seeded completions, whole and streamed, alone and eight at once
(one running batch on the GPU), must give the CPU's text; the model config must say
where it runs (KIND_GPU) and which paths its steps take there (torch's, named).
These need a GPU that torch can use and are skipped anywhere else (CI has none); their last
run on one is recorded in docs/benchmarks.md, "Generation on a GPU".
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from .charllama import char_llama_folder
from .conftest import ServedProcess, start_served_process

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch sees none here"
)

MAX_MODEL_LEN = 256
MODELS = {"cpu": "llama-cpu", "cuda:0": "llama-gpu"}
CONFIG = "models:\n" + "".join(
    f"""\
  - name: {name}
    kind: generation
    source: {{folder}}
    device: {device}
    block_size: 8
    num_blocks: 128
    max_num_seqs: 8
    max_num_batched_tokens: 64
    max_model_len: {MAX_MODEL_LEN}
"""
    for device, name in MODELS.items()
)
PROMPTS = ["Share the ride", "Carpools", "a", "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    root = tmp_path_factory.mktemp("cuda_generation")
    folder = char_llama_folder(root / "model", MAX_MODEL_LEN)
    server = start_served_process(CONFIG.format(folder=folder), root)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output(), server.output()


@pytest.fixture
def client(served: ServedProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="-", max_retries=0) as c:
        yield c


def _complete(client: openai.OpenAI, model: str, prompt: str, **fields: Any) -> str:
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}, **fields
    )
    return response.choices[0].text


def test_the_gpu_model_says_where_it_runs_and_which_paths(served: ServedProcess) -> None:
    config = httpx.get(f"http://{served.http_url}/v2/models/{MODELS['cuda:0']}/config").json()
    assert config["instance_group"][0]["kind"] == "KIND_GPU"
    parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert parameters["decode_attention"] == "torch"  # the C++ kernels are the CPU's
    assert parameters["elementwise"] == "torch"
    assert parameters["linear"] == "aten-linear"
    assert parameters["huge_pages"] == "off: cuda memory"


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5, "presence_penalty": 0.5}],
    ids=["greedy", "seeded"],
)
def test_each_completion_on_the_gpu_is_the_cpus(
    client: openai.OpenAI, fields: dict[str, Any]
) -> None:
    for prompt in PROMPTS:
        want = _complete(client, MODELS["cpu"], prompt, **fields)
        assert len(want) == 24  # one character a token
        assert _complete(client, MODELS["cuda:0"], prompt, **fields) == want


def test_a_stream_on_the_gpu_sends_the_cpus_text(client: openai.OpenAI) -> None:
    want = _complete(client, MODELS["cpu"], PROMPTS[0], temperature=0)
    stream = client.completions.create(
        model=MODELS["cuda:0"],
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want


def test_eight_at_once_on_the_gpu_answer_as_each_alone(
    served: ServedProcess, client: openai.OpenAI
) -> None:
    prompts = [f"{p} #{i}" for i, p in enumerate(PROMPTS * 2)]
    alone = [_complete(client, MODELS["cpu"], p, temperature=0) for p in prompts]

    async def together() -> list[str]:
        url = f"http://{served.http_url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0) as c:
            answers = await asyncio.gather(*(
                c.completions.create(model=MODELS["cuda:0"], prompt=p, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
                for p in prompts
            ))  # fmt: skip
        return [a.choices[0].text for a in answers]

    assert asyncio.run(together()) == alone
