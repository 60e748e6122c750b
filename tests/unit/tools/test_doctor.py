"""``carpool doctor`` end to end: options, loading a model, the verdicts, the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from carpool.cli import app
from carpool.errors import ConfigError, ModelError
from carpool.tools.doctor import load_target, run_doctor
from carpool.tools.doctor_types import DoctorOptions, DoctorReport

HERE = Path(__file__).resolve().parent


class TickClock:
    """Advances 1 ms per reading: time never comes from the wall clock."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


class FakeMemory:
    def __init__(self) -> None:
        self.num_windows = 0

    def start(self) -> None:
        self.num_windows += 1

    def stop(self) -> int:
        return 1024 * 1024 * self.num_windows


@pytest.fixture
def doctormodels(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(HERE))
    import doctormodels

    return doctormodels


def _doctor(model: Any, **overrides: Any) -> DoctorReport:
    fields: dict[str, Any] = {"shape": (8,), "max_batch": 8, "repeats": 2, "warmup": 1}
    options = DoctorOptions(**(fields | overrides))
    return run_doctor(
        load_target(model, dtype=options.dtype), options, clock=TickClock(), memory=FakeMemory()
    )


# -- torch models ---------------------------------------------------------------------------


def test_flags_batchnorm_in_training_mode_by_structure_and_behaviour(doctormodels: Any) -> None:
    report = _doctor(doctormodels.build_torch("batch", is_training=True))
    inv = report.invariance
    assert not inv.is_passed
    assert any("BatchNorm1d" in flag and "training mode" in flag for flag in inv.structural)
    flagged = {d.kind for d in inv.deviations if d.is_flagged}
    assert {"random", "large", "zeros"} <= flagged
    assert any("a batch of 1 fails" in reason for reason in inv.reasons)


@pytest.mark.parametrize(("norm", "is_training"), [("group", True), ("batch", False)])
def test_passes_models_without_batch_statistics(
    doctormodels: Any, norm: str, is_training: bool
) -> None:
    report = _doctor(doctormodels.build_torch(norm, is_training=is_training))
    assert report.invariance.is_passed, report.invariance.reasons
    assert report.invariance.structural == []


# -- NumPy models ---------------------------------------------------------------------------


def test_flags_numpy_model_subtracting_the_batch_mean(doctormodels: Any) -> None:
    report = _doctor(doctormodels.batch_mean)
    assert not report.invariance.is_passed
    assert any("cross-sample dependency" in reason for reason in report.invariance.reasons)
    assert report.invariance.structural == []


def test_passes_per_item_numpy_model_and_reports_every_batch_size(doctormodels: Any) -> None:
    report = _doctor(doctormodels.per_item, max_batch=6, memory_budget_bytes=4 * 1024 * 1024)
    assert report.invariance.is_passed, report.invariance.reasons
    assert [t.batch_size for t in report.sweep] == [1, 2, 4, 6]
    assert report.memory is not None


def test_flags_outputs_that_change_with_padding_length(doctormodels: Any) -> None:
    report = _doctor(doctormodels.padded_mean, shape=(-1, 4), lengths=(4, 8, 16))
    kinds = {d.kind for d in report.invariance.deviations if d.is_flagged}
    assert {"padding", "longer"} <= kinds
    assert report.lengths is not None
    assert report.lengths.bucket_edges[-1] == 16


def test_passes_a_model_that_ignores_zero_padding(doctormodels: Any) -> None:
    report = _doctor(doctormodels.masked_sum, shape=(-1, 4), lengths=(4, 8))
    assert report.invariance.is_passed, report.invariance.reasons


# -- loading --------------------------------------------------------------------------------


def test_loads_device_factories_and_dict_outputs(doctormodels: Any) -> None:
    batch = np.ones((3, 8), dtype=np.float32)
    assert load_target("doctormodels:make_per_item").call(batch)["output"].shape == (3, 4)
    outputs = load_target(doctormodels.as_dict).call(batch)
    assert {name: v.shape for name, v in outputs.items()} == {"proj": (3, 4), "total": (3,)}


def test_a_zero_argument_factory_of_an_nn_module_is_run_and_inspected_as_that_module(
    doctormodels: Any,
) -> None:
    target = load_target("doctormodels:build_group_norm")
    assert [type(m).__name__ for m in target.modules] == ["Sequential"]
    assert target.call(np.ones((3, 8), dtype=np.float32))["output"].shape == (3, 4)


def test_a_source_that_fits_no_form_is_refused_listing_the_forms(doctormodels: Any) -> None:
    with pytest.raises(ConfigError) as info:
        load_target("doctormodels:_WEIGHTS")
    message = str(info.value)
    assert "it names a value of type ndarray" in message
    for form in ("batched callable", "named device", "zero-argument factory", "nn.Module"):
        assert form in message
    assert "--config FILE --model NAME" in message


def test_rejects_outputs_not_aligned_with_the_batch() -> None:
    target = load_target(lambda batch: batch.sum(axis=0))
    with pytest.raises(ModelError, match="align with the inputs along axis 0"):
        target.call(np.ones((3, 8), dtype=np.float32))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"shape": (-1, 4)}, "lengths"),
        ({"shape": (-1, -1), "lengths": (2,)}, "shape"),
        ({"max_batch": 0}, "max_batch"),
        ({"dtype": "float33"}, "dtype"),
        ({"knee_gain": 1.0}, "knee_gain"),
        ({"pad_axis": 3}, "pad_axis"),
    ],
)
def test_rejects_invalid_options(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        DoctorOptions(**({"shape": (8,)} | overrides))
    assert info.value.field == field


# -- command line ---------------------------------------------------------------------------


def test_cli_writes_json_with_numbers_machine_and_verdicts(
    doctormodels: Any, tmp_path: Path
) -> None:
    out = tmp_path / "doctor.json"
    args = ["doctor", "doctormodels:per_item", "--shape", "8", "--dtype", "float32"]
    args += ["--max-batch", "4", "--repeats", "2", "--warmup", "0", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Batch invariance: PASS" in result.output
    data = json.loads(out.read_text())
    assert {"sweep", "knee", "invariance", "machine", "options", "verdicts"} <= data.keys()
    assert {"platform", "cpu_model", "torch"} <= data["machine"].keys()
    assert [row["batch_size"] for row in data["sweep"]] == [1, 2, 4]
    assert data["verdicts"]["invariance_passed"] is True


def test_cli_takes_a_variable_dim_and_reports_buckets(doctormodels: Any) -> None:
    args = ["doctor", "doctormodels:masked_sum", "--shape", "-1,4", "--lengths", "4,8"]
    result = CliRunner().invoke(app, [*args, "--max-batch", "2", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert "suggested bucket edges:" in result.output


def test_cli_strict_exits_1_when_invariance_fails(doctormodels: Any) -> None:
    args = ["doctor", "doctormodels:batch_mean", "--shape", "8", "--max-batch", "4"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--strict"])
    assert result.exit_code == 1
    assert "Batch invariance: FAIL" in result.output


@pytest.mark.parametrize(
    "extra",
    [
        *(["--memory-budget-mb", v] for v in ("-1", "0", "nan", "inf", "1e-9")),
        ["--knee-gain", "nan"],  # was taken: "grows by >= nanx per doubling"
        ["--knee-gain", "1"],
        ["--probes", "0"],  # was named num_probes
        ["--warmup", "-1"],  # was named repeats=(15, -1)
        ["--repeats", "0"],
    ],
)
def test_cli_exits_2_naming_the_flag_of_a_value_it_cannot_take(
    doctormodels: Any, extra: list[str]
) -> None:
    args = ["doctor", "doctormodels:per_item", "--shape", "8", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"invalid {extra[0]}=" in result.output


def test_cli_exits_2_naming_a_source_that_cannot_be_imported() -> None:
    result = CliRunner().invoke(app, ["doctor", "no_such_module:fn", "--shape", "8"])
    assert result.exit_code == 2
    assert "no_such_module:fn" in result.output


@pytest.mark.parametrize(
    "attr",
    ["per_item", "make_per_item", "build_per_item", "build_group_norm"],
    ids=["batched-callable", "device-factory", "factory-of-callable", "factory-of-nn-module"],
)
def test_cli_measures_a_model_named_in_each_module_attr_form(doctormodels: Any, attr: str) -> None:
    args = ["doctor", f"doctormodels:{attr}", "--shape", "8", "--max-batch", "2"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert "Batch invariance: PASS" in result.output


SERVE_CONFIG = """
models:
  - name: numpy
    kind: python
    source: doctormodels:by_name
    inputs: [{name: x, datatype: FP32, shape: [8]}]
    outputs: [{name: y, datatype: FP32, shape: [4]}]
  - name: net
    kind: torch
    source: doctormodels:build_group_norm
    inputs: [{name: x, datatype: FP32, shape: [8]}]
    outputs: [{name: y, datatype: FP32, shape: [4]}]
  - name: pair
    kind: python
    source: doctormodels:by_name
    inputs: [{name: x, datatype: FP32, shape: [8]}, {name: z, datatype: FP32, shape: [8]}]
    outputs: [{name: y, datatype: FP32, shape: [4]}]
"""
FAST = ["--max-batch", "2", "--repeats", "1", "--warmup", "0"]


@pytest.fixture
def serve_config(doctormodels: Any, tmp_path: Path) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_CONFIG)
    return path


@pytest.mark.parametrize("name", ["numpy", "net"])
def test_cli_measures_a_model_of_a_serve_config_with_its_input_shape(
    serve_config: Path, name: str, tmp_path: Path
) -> None:
    out = tmp_path / "doctor.json"
    args = ["doctor", "--config", str(serve_config), "--model", name, "--json", str(out)]
    result = CliRunner().invoke(app, [*args, *FAST])
    assert result.exit_code == 0, result.output
    assert f"--config {serve_config} --model {name}  item shape (8) float32" in result.output
    assert "Batch invariance: PASS" in result.output
    data = json.loads(out.read_text())
    assert [row["batch_size"] for row in data["sweep"]] == [1, 2]
    assert {row["output"] for row in data["invariance"]["deviations"]} == {"y"}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], "invalid --model=None: expected the name of a model in the config: one of "
             "['numpy', 'net', 'pair']"),
        (["--model", "nets"], "invalid --model='nets'"),
        (["--model", "pair"], "one input: carpool doctor sweeps one tensor; this model takes "
                              "['x', 'z']"),
        (["--model", "numpy", "doctormodels:per_item"], "either SOURCE or --config"),
    ],
    ids=["no-model", "unknown-model", "two-inputs", "source-and-config"],
)  # fmt: skip
def test_cli_exits_2_saying_which_models_a_config_offers(
    serve_config: Path, extra: list[str], expected: str
) -> None:
    result = CliRunner().invoke(app, ["doctor", "--config", str(serve_config), *extra, *FAST])
    assert result.exit_code == 2
    assert expected in result.output
    if extra[:2] == ["--model", "nets"]:
        assert "['numpy', 'net', 'pair']" in result.output


def test_cli_reports_the_cpu_flags_and_the_linear_kernels_that_ran(
    doctormodels: Any, tmp_path: Path
) -> None:
    out = tmp_path / "doctor.json"
    args = ["doctor", "doctormodels:build_group_norm", "--shape", "8", "--max-batch", "2"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "cpu flags:" in result.output
    assert "this model's Linear layers: aten-linear" in result.output
    machine = json.loads(out.read_text())["machine"]
    assert machine["model_linear"] == "aten-linear"
    assert set(machine["kernels"]["linear"]) == {"float32", "bfloat16"}
