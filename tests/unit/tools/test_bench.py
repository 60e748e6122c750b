"""``carpool bench`` flags and a short in-process run through ``main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool.errors import ConfigError
from carpool.tools.bench import build_parser, config_from_args, main
from carpool.tools.loadgen import Arrival
from carpool.tools.targets import Wire

MODULE = """
import numpy as np

def double(batch):
    return np.asarray(batch) * 2

def double_by_name(inputs):
    return {"y": np.asarray(inputs["x"]) * 2}

not_callable = 3
"""
SERVE_CONFIG = """
models:
  - name: doubled
    kind: python
    source: benchclimodels:double_by_name
    inputs: [{name: x, datatype: FP32, shape: [8]}]
    outputs: [{name: y, datatype: FP32, shape: [8]}]
"""


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(["http://127.0.0.1:9", *argv]))


def test_concurrency_sweep_and_defaults() -> None:
    config = _config("--model", "mlp", "--concurrency", "1,16,64")
    assert [p.concurrency for p in config.points] == [1, 16, 64]
    assert (config.duration_s, config.warmup_s) == (10.0, 2.0)
    assert config.spec.wire is Wire.KSERVE_BINARY
    assert config.show_progress is False  # stderr is not a terminal under pytest


def test_rate_sweep_is_open_loop_with_the_arrival_shape() -> None:
    config = _config(
        "--rate", "100,250", "--arrival", "gamma", "--burstiness", "4", "--duration", "2s"
    )
    assert [p.label for p in config.points] == ["rate=100", "rate=250"]
    arrivals = config.points[1].arrivals
    assert arrivals is not None and arrivals.arrival is Arrival.GAMMA
    assert (arrivals.burstiness, arrivals.steps[0].rate_rps, config.duration_s) == (4.0, 250.0, 2.0)


def test_schedule_and_trace(tmp_path: Path) -> None:
    config = _config("--schedule", "0:50,10s:200")
    assert config.points[0].arrivals is not None
    trace = tmp_path / "t.txt"
    trace.write_text("0\n0.5\n1.5\n")
    config = _config("--trace", str(trace))
    assert config.duration_s == pytest.approx(1.5)  # a trace runs to its end by default


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--concurrency", "4", "--rate", "10"], "only one of"),
        (["--concurrency", "0"], "concurrency"),
        (["--rate", "fast"], "rate"),
        (["--duration", "0s"], "duration"),
        (["--input-shape", "1,x"], "input-shape"),
        (["--texts", "/nonexistent/texts.txt"], "texts"),
        (["--dtype", "FOO"], "invalid dtype='FOO'"),  # was found only after connecting
        (["--max-connections", "0"], "max-connections"),
    ],
)
def test_bad_flags_are_config_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _config(*argv)


def test_a_trace_with_every_request_at_once_needs_a_duration(tmp_path: Path) -> None:
    trace = tmp_path / "t.txt"
    trace.write_text("0\n0\n0\n")
    with pytest.raises(ConfigError, match=r"spanning 0\.1 s or more, or --duration"):
        _config("--trace", str(trace))
    assert _config("--trace", str(trace), "--duration", "1s").duration_s == 1.0


def test_a_plots_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path: Path) -> None:
    """Was found only after the run, with a traceback, and the HTML report was lost."""
    in_the_way = tmp_path / "afile"
    in_the_way.write_text("")
    with pytest.raises(ConfigError, match="plots"):
        _config("--concurrency", "1", "--plots", str(in_the_way / "plots"))
    assert _config("--concurrency", "1", "--plots", str(tmp_path / "p")).plots_dir == tmp_path / "p"


def test_main_exits_2_on_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["http://127.0.0.1:9", "--concurrency", "0"])
    assert exit_info.value.code == 2
    assert "carpool bench: invalid concurrency" in capsys.readouterr().err


def test_main_exits_1_when_the_server_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["http://127.0.0.1:9", "--model", "m", "--duration", "0.1s", "--warmup", "0"])
    assert exit_info.value.code == 1
    assert "http://127.0.0.1:9" in capsys.readouterr().err


def test_in_process_run_writes_json_csv_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "benchclimodels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    main([
        "benchclimodels:double", "--input-shape", "2,8", "--concurrency", "1,4",
        "--duration", "0.2s", "--warmup", "0.05s", "--json", str(out / "b.json"),
        "--csv", str(out / "b.csv"), "--plots", str(out / "plots"), "--no-progress",
    ])  # fmt: skip
    document = json.loads((out / "b.json").read_text())
    assert [p["label"] for p in document["points"]] == ["concurrency=1", "concurrency=4"]
    for point in document["points"]:
        assert point["summary"]["num_errors"] == 0
        assert point["summary"]["rate_rps"] > 0
        assert point["summary"]["items_per_s"] == pytest.approx(2 * point["summary"]["rate_rps"])
        assert point["server"]["mean_batch_size"] >= 2
    assert (out / "b.csv").exists() and (out / "plots" / "latency_cdf.png").exists()
    assert "concurrency=4" in capsys.readouterr().out


@pytest.fixture
def serve_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "benchclimodels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_CONFIG)
    return path


def test_in_process_run_of_a_serve_config_model(serve_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    main([
        "--config", str(serve_config), "--model", "doubled", "--input-shape", "2",
        "--concurrency", "2", "--duration", "0.2s", "--warmup", "0", "--json", str(out),
        "--no-progress",
    ])  # fmt: skip
    document = json.loads(out.read_text())
    assert document["target"] == f"--config {serve_config} --model doubled"
    summary = document["points"][0]["summary"]
    assert summary["num_errors"] == 0 and summary["rate_rps"] > 0
    assert summary["items_per_s"] == pytest.approx(2 * summary["rate_rps"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--concurrency", "1"], "http://host:port (a server), or one of: module:attr naming"),
        (["benchclimodels:not_callable"], "it names a value of type int"),
        (["--config", "{config}"], "one of ['doubled']"),
        (["--config", "{config}", "http://127.0.0.1:9", "--model", "doubled"], "no --config"),
    ],
    ids=["no-target", "no-form", "config-without-model", "config-and-url"],
)
def test_main_exits_2_when_no_model_is_named_in_a_form_it_takes(
    serve_config: Path, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(config=serve_config) for arg in argv])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err
