"""``carpool serve CONFIG.yaml``: reading and validating the file."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import get_args

import pytest
import yaml

from carpool.config import Datatype, ServeConfig, load_config, parse_config
from carpool.core.policy import BatchPolicy, ClassPolicy
from carpool.errors import ConfigError
from carpool.server.kserve.tensors import DATATYPES

VALID = """\
models:
  - name: doubler
    kind: python
    source: mypkg.mod:double
    version: "2"
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 64
    max_delay_s: 0.002
    preferred_batch_sizes: [16, 32]
    max_queue_size: 1000
    timeout_s: 1.5
    fill_from_lower: false
    preempt: true
    classes:
      - {name: high, max_delay_s: 0.001, slo_s: 0.05}
      - {name: low, share: 0.5, max_wait_s: 2}
    default_class: low
    devices: [cpu, cpu]
  - name: classifier
    kind: onnx
    source: model.onnx
    device: cpu
"""


def _write(tmp_path: Path, text: str, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    (tmp_path / "model.onnx").write_bytes(b"")  # only its existence is checked here
    return tmp_path


def _error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return caught.value


def _with_model_line(line: str) -> str:
    """The valid file with one more key for the first model."""
    return VALID.replace('    version: "2"\n', f'    version: "2"\n    {line}\n')


def test_reads_every_field_into_typed_values(config_dir: Path) -> None:
    config = load_config(_write(config_dir, VALID))
    doubler, classifier = config.models
    assert (doubler.name, doubler.kind, doubler.source, doubler.version) == (
        "doubler",
        "python",
        "mypkg.mod:double",
        "2",
    )
    assert doubler.inputs is not None and doubler.inputs[0].shape == [-1]
    assert doubler.replica_devices() == ["cpu", "cpu"]
    assert doubler.policy() == BatchPolicy(
        max_batch_size=64,
        max_delay_s=0.002,
        preferred_batch_sizes=(16, 32),
        max_queue_size=1000,
        timeout_s=1.5,
        fill_from_lower=False,
        preempt=True,
        classes=(
            ClassPolicy("high", max_delay_s=0.001, slo_s=0.05),
            ClassPolicy("low", share=0.5, max_wait_s=2.0),
        ),
        default_class="low",
    )
    assert classifier.inputs is None and classifier.outputs is None
    assert classifier.source == str((config_dir / "model.onnx").resolve())


def test_left_out_policy_fields_are_batch_policy_defaults(config_dir: Path) -> None:
    config = load_config(_write(config_dir, VALID))
    assert config.models[1].policy() == BatchPolicy()
    assert config.models[1].replica_devices() == ["cpu"]


def test_batch_timeout_is_read_and_null_means_no_limit(config_dir: Path) -> None:
    config = load_config(_write(config_dir, _with_model_line("batch_timeout_s: 2.5")))
    assert config.models[0].policy().batch_timeout_s == 2.5
    assert config.models[1].policy().batch_timeout_s == 60.0
    config = load_config(_write(config_dir, _with_model_line("batch_timeout_s: null")))
    assert config.models[0].policy().batch_timeout_s is None


def test_round_trips_through_yaml(config_dir: Path) -> None:
    config = load_config(_write(config_dir, VALID))
    dumped = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    again = load_config(_write(config_dir, dumped, "again.yaml"))
    assert again == config


def test_integer_version_reads_as_a_string(config_dir: Path) -> None:
    config = load_config(_write(config_dir, VALID.replace('version: "2"', "version: 3")))
    assert config.models[0].version == "3"


def test_config_datatypes_are_the_server_datatypes() -> None:
    assert set(get_args(Datatype)) == set(DATATYPES)


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        (_with_model_line("max_dealy_s: 0.002"), "models[0].max_dealy_s", "'max_delay_s'"),
        (
            VALID.replace("max_batch_size: 64", "max_batch_size: many"),
            "models[0].max_batch_size",
            "integer",
        ),
        (
            VALID.replace("max_batch_size: 64", "max_batch_size: true"),
            "models[0].max_batch_size",
            "integer",
        ),
        (
            VALID.replace("max_delay_s: 0.002", "max_delay_s: -0.5"),
            "models[0].max_delay_s",
            "greater than or equal to 0",
        ),
        (
            VALID.replace("name: classifier", "name: doubler"),
            "models[1].name",
            "models[0] has it",
        ),
        (VALID.replace("kind: onnx", "kind: tensorflow"), "models[1].kind", "'python'"),
        (
            VALID.replace("    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]\n", ""),
            "models[0].inputs",
            "cannot tell its inputs",
        ),
        (
            VALID.replace(
                "datatype: FP32, shape: [-1]}]\n    outputs",
                "datatype: F32, shape: [-1]}]\n    outputs",
            ),
            "models[0].inputs[0].datatype",
            "'FP32'",
        ),
        (
            VALID.replace("shape: [-1]}]\n    outputs", "shape: [-2]}]\n    outputs"),
            "models[0].inputs[0].shape",
            "dimensions >= 1, or -1",
        ),
        (
            VALID.replace("preferred_batch_sizes: [16, 32]", "preferred_batch_sizes: [128]"),
            "models[0].preferred_batch_sizes",
            "no larger than max_batch_size=64",
        ),
        (
            VALID.replace("default_class: low", "default_class: normal"),
            "models[0].default_class",
            "one of ['high', 'low']",
        ),
        (
            VALID.replace("share: 0.5", "share: 2"),
            "models[0].classes[1].share",
            "less than or equal to 1",
        ),
        (_with_model_line("num_replicas: 3"), "models[0].num_replicas", "one replica per"),
        (_with_model_line("dtype: float16"), "models[0].dtype", "only torch"),
        (_with_model_line("quantization: int8"), "models[0].quantization", "only embeddings"),
        (_with_model_line("max_inputs: 3"), "models[0].max_inputs", "only embeddings"),
        (_with_model_line("quantization: int4"), "models[0].quantization", "int8"),
        (VALID.replace("source: model.onnx", "source: gone.onnx"), "models[1].source", "gone"),
        (
            VALID.replace("source: mypkg.mod:double", "source: double.py"),
            "models[0].source",
            "module:attr",
        ),
        (VALID.replace("    source: model.onnx\n", ""), "models[1].source", "required"),
        (
            "models:\n  - {name: e, kind: embeddings, source: nowhere}\n",
            "models[0].source",
            "config.json is missing",
        ),
        (_with_model_line("length_buckets: [64, 16]"), "models[0].length_buckets", "ascending"),
        (_with_model_line("max_batch_tokens: 0"), "models[0].max_batch_tokens", "greater than"),
        (_with_model_line("executor: fork"), "models[0].executor", "'process'"),
        (
            _with_model_line("replica_cpus: [[0], [1]]"),
            "models[0].replica_cpus",
            "nothing unless executor: process",
        ),
        (
            _with_model_line("ray_resources: {num_cpus: 1}"),
            "models[0].ray_resources",
            "nothing unless executor: ray",
        ),
        (
            _with_model_line("executor: ray\n    ray_resources: {num_gpus: -1}"),
            "models[0].ray_resources.num_gpus",
            "a number >= 0",
        ),
        (
            _with_model_line("executor: ray\n    ray_resources: {num_cpus: one}"),
            "models[0].ray_resources",
            "a valid number",
        ),
        (
            _with_model_line("executor: ray\n    max_restarts: -2"),
            "models[0].max_restarts",
            "greater than or equal to -1",
        ),
        (
            _with_model_line("ray_placement: {strategy: SPREAD}"),
            "models[0].ray_placement",
            "nothing unless executor: ray",
        ),
        (
            _with_model_line("executor: ray\n    ray_placement: {strategy: spread}"),
            "models[0].ray_placement",
            "'STRICT_SPREAD'",
        ),
        (
            _with_model_line("executor: ray\n    ray_placement: {strategy: PACK, name: g}"),
            "models[0].ray_placement.name",
            "known keys: strategy",
        ),
        (VALID + "ray: {adress: auto}\n", "ray.adress", "did you mean 'address'?"),
        (_with_model_line("batch_timeout_s: 0"), "models[0].batch_timeout_s", "greater than 0"),
        (_with_model_line('buffer_pool: "on"'), "models[0].buffer_pool", "valid boolean"),
        (_with_model_line("buffer_pool_mb: 0"), "models[0].buffer_pool_mb", "greater than 0"),
        (_with_model_line("cuda_graphs: true"), "models[0].cuda_graphs", "only torch models"),
        (_with_model_line("autocast: true"), "models[0].autocast", "only torch models"),
        (_with_model_line("batch_timeout_s: .inf"), "models[0].batch_timeout_s", "finite"),
        (
            VALID.replace(
                "datatype: FP32, shape: [-1]}]\n    max_batch",
                "datatype: FP32, shape: [-1], ragged: true}]\n    max_batch",
            ),
            "models[0].outputs[0].ragged",
            "only inputs are ragged",
        ),
        (
            VALID.replace(
                "[{name: INPUT0, datatype: FP32, shape: [-1]}]",
                "[{name: INPUT0, datatype: FP32, shape: [], ragged: true}]",
            ),
            "models[0].inputs[0].ragged",
            "shape has a first dimension",
        ),
        ("models: []\n", "models", "at least 1 item"),
        ("", "(top level)", "the file is empty"),
        ("models:\n  - name: [\n", "line 3", "valid YAML"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 and "\n" not in v else "",
)
def test_errors_name_file_key_and_reason(
    config_dir: Path, text: str, key: str, reason: str
) -> None:
    path = _write(config_dir, text)
    error = _error(path)
    message = str(error)
    assert message.startswith(f"{path}: invalid {key}")
    assert reason in message
    assert error.file == str(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    error = _error(tmp_path / "nope.yaml")
    assert error.field == "file" and "nope.yaml" in str(error)


def test_config_duplicate_key_is_an_error(tmp_path: Path) -> None:
    # PyYAML keeps the last of two equal keys: max_batch_size 8 silently becomes 64.
    path = _write(tmp_path, _with_model_line("max_batch_size: 8"))  # and 64 further down
    with pytest.raises(ConfigError, match="max_batch_size"):
        load_config(path)


def test_a_yaml_merge_key_merges_and_the_mapping_s_own_keys_win(tmp_path: Path) -> None:
    """Was: ``<<: *base`` was refused as "not valid YAML" (the duplicate-key check built
    the merge key without its constructor)."""
    text = VALID.replace("  - name: doubler\n", "  - &base\n    name: doubler\n", 1)
    text = text.replace(
        "  - name: classifier\n    kind: onnx\n    source: model.onnx\n    device: cpu\n",
        "  - <<: *base\n    name: twin\n    max_batch_size: 32\n",
    )
    models = load_config(_write(tmp_path, text)).models
    assert [(m.name, m.max_batch_size, m.source) for m in models] == [
        ("doubler", 64, "mypkg.mod:double"),
        ("twin", 32, "mypkg.mod:double"),
    ]


def test_a_key_that_is_a_list_is_a_config_error_not_a_crash(tmp_path: Path) -> None:
    """Was: ``? [x, y]`` raised TypeError (unhashable) out of the loader: a traceback and
    exit 1 where a bad file is one line and exit 2."""
    error = _error(_write(tmp_path, VALID + "? [x, y]\n: 1\n"))
    assert "a key must be a plain value" in str(error)


def test_reports_how_many_more_problems_there_are(config_dir: Path) -> None:
    text = VALID.replace("max_delay_s: 0.002", "max_delay_s: -1").replace(
        "max_batch_size: 64", "max_batch_size: 0"
    )
    assert "1 more problem" in str(_error(_write(config_dir, text)))


def test_parse_config_checks_a_dict() -> None:
    with pytest.raises(ConfigError, match=r"<config>: invalid models\[0\].source"):
        parse_config({"models": [{"name": "m", "kind": "python"}]})
    config = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "kind": "python",
                    "source": "a:b",
                    "inputs": [{"name": "X", "datatype": "INT64", "shape": []}],
                    "outputs": [{"name": "Y", "datatype": "INT64", "shape": []}],
                }
            ]
        }
    )
    assert isinstance(config, ServeConfig)


def test_embeddings_entry_reads_a_folder_and_token_policy(config_dir: Path) -> None:
    (config_dir / "minilm").mkdir()
    (config_dir / "minilm" / "config.json").write_text("{}")
    text = (
        "models:\n  - name: e\n    kind: embeddings\n    source: minilm\n"
        "    max_batch_tokens: 8192\n    length_buckets: auto\n    max_inputs: 16\n"
        "    dtype: bfloat16\n"
    )
    model = load_config(_write(config_dir, text)).models[0]
    assert model.source == str((config_dir / "minilm").resolve())
    assert model.max_inputs == 16
    assert model.quantization is None
    int8 = text.replace("dtype: bfloat16", "quantization: int8")
    assert load_config(_write(config_dir, int8)).models[0].quantization == "int8"
    policy = model.policy()
    assert (policy.max_batch_tokens, policy.length_buckets) == (8192, "auto")
    edges = load_config(_write(config_dir, text.replace("auto", "[32, 128]"))).models[0]
    assert edges.policy().length_buckets == (32, 128)
    declared = text + "    inputs: [{name: T, datatype: BYTES, shape: []}]\n"
    with pytest.raises(ConfigError, match=r"models\[0\]\.inputs.*declares its own"):
        load_config(_write(config_dir, declared))


def test_buffer_pool_is_read_and_on_when_absent(config_dir: Path) -> None:
    config = load_config(_write(config_dir, _with_model_line("buffer_pool: false")))
    assert config.models[0].buffer_pool is False
    assert config.models[0].buffer_pool_mb == 256
    assert config.models[1].buffer_pool is True
    config = load_config(_write(config_dir, _with_model_line("buffer_pool_mb: 64")))
    assert config.models[0].buffer_pool_mb == 64


def test_executor_is_read_and_left_to_the_kind_when_absent(config_dir: Path) -> None:
    config = load_config(_write(config_dir, _with_model_line("executor: loop")))
    assert config.models[0].executor == "loop"
    assert config.models[1].executor is None
    text = _with_model_line("executor: process\n    replica_cpus: [[0], [1]]")
    config = load_config(_write(config_dir, text))
    assert config.models[0].executor == "process"
    assert config.models[0].replica_cpus == [[0], [1]]


def test_executor_ray_is_only_for_batched_kinds(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    text = "models:\n  - {name: e, kind: embeddings, source: folder, executor: ray}\n"
    error = _error(_write(tmp_path, text))
    assert (error.field, error.value) == ("models[0].executor", "ray")
    assert "thread, loop or auto for this kind of model" in str(error)


def test_ray_options_and_the_ray_section_are_read(config_dir: Path) -> None:
    text = _with_model_line(
        "executor: ray\n    ray_resources: {num_cpus: 1, num_gpus: 0.5, accel: 2}\n"
        "    max_restarts: 5\n    ray_placement: {strategy: STRICT_SPREAD}"
    )
    text += "ray: {address: auto, namespace: serving}\n"
    config = load_config(_write(config_dir, text))
    model = config.models[0]
    assert (model.executor, model.max_restarts) == ("ray", 5)
    assert model.ray_placement is not None and model.ray_placement.strategy == "STRICT_SPREAD"
    assert model.ray_resources == {"num_cpus": 1.0, "num_gpus": 0.5, "accel": 2.0}
    assert config.ray is not None
    assert (config.ray.address, config.ray.namespace, config.ray.runtime_env) == (
        "auto",
        "serving",
        None,
    )
    assert load_config(_write(config_dir, VALID)).ray is None
