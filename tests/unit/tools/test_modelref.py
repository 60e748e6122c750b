"""Naming a model for doctor, tune and bench: each form told apart, built, or refused."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, batched
from carpool.errors import ConfigError
from carpool.tools.modelref import (
    MODEL_FORMS,
    ConfiguredModel,
    Form,
    ImportedModel,
    ModuleCall,
    form_of,
    resolve,
    resolve_import,
)


def double(batch: np.ndarray) -> np.ndarray:
    return batch * 2


def make_double(device: str) -> Any:
    return double


def build_double() -> Any:
    return double


def build_linear(features: int = 4) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(features, 2)


def build_number() -> int:
    return 3


def by_name(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


class Doubler:
    def __call__(self, batch: np.ndarray) -> np.ndarray:
        return batch * 2


class DeviceDoubler:
    def __init__(self, device: str) -> None:
        self.device = device

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        return batch * 2


def gather(*batches: np.ndarray) -> np.ndarray:
    return np.concatenate(batches)


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = types.ModuleType("modelref_models")
    for name, value in {
        "double": double,
        "make_double": make_double,
        "build_double": build_double,
        "build_linear": build_linear,
        "build_number": build_number,
        "by_name": by_name,
        "batched_double": batched(double),
        "batcher": Batcher(double),
        "number": 3,
    }.items():
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, "modelref_models", module)
    monkeypatch.syspath_prepend(str(Path.cwd()))  # resolve_config adds to sys.path: undone
    yield "modelref_models"


@pytest.mark.parametrize(
    ("obj", "form"),
    [
        (double, Form.CALLABLE),
        (gather, Form.CALLABLE),  # *args: the batch may come that way
        (np.tanh, Form.CALLABLE),  # no signature to read
        (Doubler(), Form.CALLABLE),
        (make_double, Form.DEVICE_FACTORY),
        (DeviceDoubler, Form.DEVICE_FACTORY),
        (build_double, Form.FACTORY),
        (build_linear, Form.FACTORY),  # its one parameter has a default
        (Doubler, Form.FACTORY),
        (batched(double), Form.BATCHED),
        (Batcher(double), Form.BATCHER),
        (3, None),
    ],
)
def test_tells_the_form_from_what_module_attr_names(obj: Any, form: Form | None) -> None:
    assert form_of(obj) is form


def test_tells_an_nn_module_instance() -> None:
    pytest.importorskip("torch")
    assert form_of(build_linear()) is Form.MODULE


@pytest.mark.parametrize("attr", ["double", "make_double", "build_double", "batched_double"])
def test_every_callable_form_builds_the_batched_callable(models: str, attr: str) -> None:
    fn = resolve(f"{models}:{attr}", accepts=(*MODEL_FORMS, Form.BATCHED))
    assert isinstance(fn, ImportedModel)
    np.testing.assert_array_equal(fn.batched_callable("cpu")(np.ones(3)), np.full(3, 2.0))


def test_a_zero_argument_factory_of_an_nn_module_runs_on_numpy_batches(models: str) -> None:
    torch = pytest.importorskip("torch")
    ref = resolve_import(f"{models}:build_linear")
    assert ref.form is Form.FACTORY
    fn = ref.batched_callable("cpu")
    assert isinstance(fn, ModuleCall) and isinstance(fn.module, torch.nn.Linear)
    out = fn(np.ones((3, 4), dtype=np.float32))
    assert isinstance(out, np.ndarray) and out.shape == (3, 2)


def test_a_factory_returning_no_model_is_refused_saying_what_it_returned(models: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_import(f"{models}:build_number").build("cpu")
    assert str(info.value).endswith(
        "a factory returns a batched callable or an nn.Module; it returned a value of type int"
    )


@pytest.mark.parametrize(
    ("source", "names"),
    [("nocolon", "'nocolon'"), ("model.pt", "'model.pt'"), (":number", "':number'")],
)
def test_a_source_that_is_no_module_attr_is_refused_listing_every_form(
    source: str, names: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(source)
    message = str(info.value)
    assert f"invalid source={names}" in message
    for form in MODEL_FORMS:
        assert form.value in message
    assert "--config FILE --model NAME" in message and ".onnx file" in message


def test_a_form_the_command_does_not_take_is_refused_naming_it(models: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(f"{models}:batcher")
    assert str(info.value).endswith("; it names a carpool.Batcher")
    with pytest.raises(ConfigError) as info:
        resolve(f"{models}:number")
    assert str(info.value).endswith("; it names a value of type int")


def test_a_module_that_does_not_import_says_why() -> None:
    with pytest.raises(ConfigError, match="an importable module"):
        resolve("no_such_module_xyz:fn")


def test_needs_a_source_or_a_config_and_not_both(models: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid source=None: expected one of"):
        resolve(None)
    with pytest.raises(ConfigError, match="either SOURCE or --config"):
        resolve(f"{models}:double", config=str(tmp_path / "c.yaml"), model="m")
    with pytest.raises(ConfigError, match="--config FILE too"):
        resolve(f"{models}:double", model="m")


CONFIG = """
models:
  - name: doubled
    kind: python
    source: modelref_models:by_name
    inputs: [{name: x, datatype: FP32, shape: [4]}]
    outputs: [{name: y, datatype: FP32, shape: [4]}]
    max_batch_size: 8
    devices: [cpu, cpu]
  - name: missing
    kind: torch
    source: modelref_models:no_such_factory
    inputs: [{name: x, datatype: FP32, shape: [4]}]
    outputs: [{name: y, datatype: FP32, shape: [2]}]
  - name: texts
    kind: embeddings
    source: ./encoder
"""


@pytest.fixture
def config(models: str, tmp_path: Path) -> str:
    (tmp_path / "encoder").mkdir()
    (tmp_path / "encoder" / "config.json").write_text("{}")
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    return str(path)


@pytest.mark.parametrize("name", [None, "double"])
def test_a_config_model_not_named_is_refused_listing_the_configs_models(
    config: str, name: str | None
) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(None, config=config, model=name)
    assert info.value.field == "--model" and info.value.file == config
    assert "one of ['doubled', 'missing', 'texts']" in str(info.value)


def test_a_config_model_runs_as_serve_builds_it(config: str) -> None:
    entry = resolve(None, config=config, model="doubled")
    assert isinstance(entry, ConfiguredModel) and entry.key == "models[0]"
    runner = entry.runner("doctor")
    assert [spec.name for spec in runner.inputs] == ["x"]
    out = runner.fn_factory("cpu")({"x": np.ones((2, 4), dtype=np.float32)})
    np.testing.assert_array_equal(out["y"], np.full((2, 4), 2.0))


def test_a_config_model_is_served_with_its_policy_and_the_replicas_asked(config: str) -> None:
    entry = resolve(None, config=config, model="doubled")
    assert isinstance(entry, ConfiguredModel)
    served = entry.served("tune")
    assert served.batcher.policy.max_batch_size == 8 and served.batcher.num_replicas == 2
    assert entry.served("tune", num_replicas=3).batcher.devices == ("cpu",) * 3


def test_a_config_model_that_cannot_build_names_its_key_and_file(config: str) -> None:
    entry = resolve(None, config=config, model="missing")
    assert isinstance(entry, ConfiguredModel)
    with pytest.raises(ConfigError) as info:
        entry.runner("doctor")
    assert info.value.field == "models[1].source" and info.value.file == config


def test_a_text_model_of_a_config_is_refused_naming_its_kind(config: str) -> None:
    entry = resolve(None, config=config, model="texts")
    assert isinstance(entry, ConfiguredModel)
    with pytest.raises(ConfigError) as info:
        entry.runner("doctor")
    assert info.value.field == "models[2].kind"
    assert "carpool doctor runs on tensor batches (python, torch, onnx)" in str(info.value)
    assert "--protocol openai-embeddings" in str(info.value)


def test_a_text_model_passes_only_where_the_command_drives_texts(config: str) -> None:
    entry = resolve(None, config=config, model="texts")
    assert isinstance(entry, ConfiguredModel) and entry.takes_texts
    entry.check_batched("tune", texts=True)  # carpool tune drives it with tokenized texts
    with pytest.raises(ConfigError, match="carpool tune runs on tensor batches"):
        entry.check_batched("tune")
    with pytest.raises(ConfigError, match=r"models\[2\]\.kind"):
        entry.runner("tune")  # a runner without its service: still tensor batches only
