"""Edges of the command line found in review: each test was a bug a user would hit (a
traceback, a wrong exit status, a flag accepted and misread, a bad output path found only
after a long run) and failed before its fix."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carpool.cli import app
from carpool.config import load_config
from carpool.errors import ConfigError

runner = CliRunner()

PYTHON_MODEL = """\
models:
  - name: m
    kind: python
    source: numpy:negative
    inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- carpool serve: config ---------------------------------------------------------------------


def test_serve_non_utf8_config_exits_2_without_traceback(tmp_path: Path) -> None:
    # e.g. `carpool serve model.onnx` by mistake: load_config catches OSError only.
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"\x80\x81\xff\x00binary")
    result = runner.invoke(app, ["serve", str(path)])
    assert not isinstance(result.exception, UnicodeDecodeError), result.exception
    assert result.exit_code == 2


def test_config_duplicate_key_is_an_error(tmp_path: Path) -> None:
    # PyYAML keeps the last of two equal keys: max_batch_size 8 silently becomes 64.
    path = tmp_path / "serve.yaml"
    path.write_text(PYTHON_MODEL + "    max_batch_size: 8\n    max_batch_size: 64\n")
    with pytest.raises(ConfigError, match="max_batch_size"):
        load_config(path)


# -- carpool serve: flags ----------------------------------------------------------------------


def test_serve_unknown_log_level_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(PYTHON_MODEL)
    result = runner.invoke(app, ["serve", str(path), "--log-level", "bogus", "--grpc-port", "0"])
    assert not isinstance(result.exception, KeyError), repr(result.exception)
    assert result.exit_code == 2


# -- carpool bench -----------------------------------------------------------------------------


def test_bench_unwritable_json_fails_before_the_run(tmp_path: Path) -> None:
    # --json is only written after the whole sweep; an unusable path then raises a traceback.
    from carpool.tools.bench import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "numpy:negative",
                "--input-shape",
                "1,4",
                "--duration",
                "0.1s",
                "--warmup",
                "0",
                "--no-progress",
                "--json",
                str(blocker / "out.json"),
            ]
        )
    assert exit_info.value.code == 2


def test_bench_missing_model_is_a_bad_flag_exit_2() -> None:
    # bench.main: "exits 2 on a bad flag, 1 when the target fails"; no --model is a bad flag.
    from carpool.tools.bench import main

    with pytest.raises(SystemExit) as exit_info:
        main([f"http://127.0.0.1:{_closed_port()}", "--duration", "0.1s", "--warmup", "0"])
    assert exit_info.value.code == 2


# -- carpool tune ------------------------------------------------------------------------------

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


def test_tune_server_down_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from carpool.tools.tune_cli import main

    url = f"http://127.0.0.1:{_closed_port()}/v2/models/m"
    with pytest.raises(SystemExit) as exit_info:
        main([url, "--slo-p99-ms", "50", "--out", str(tmp_path / "o.yaml")])
    assert exit_info.value.code in (1, 2)


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


# -- carpool doctor ----------------------------------------------------------------------------

FAST_DOCTOR = ["--shape", "4", "--max-batch", "2", "--repeats", "1", "--warmup", "0"]


def test_doctor_factory_that_raises_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/doctor.md: exit 2 for "a model that cannot be loaded".
    from carpool.tools.doctor import main

    (tmp_path / "review_broken_factory.py").write_text(
        textwrap.dedent(
            """\
            def make(device):
                raise RuntimeError("no weights here")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["review_broken_factory:make", *FAST_DOCTOR])
    assert exit_info.value.code == 2


def test_doctor_threads_zero_is_a_usage_error() -> None:
    from carpool.tools.doctor import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", *FAST_DOCTOR, "--threads", "0"])
    assert exit_info.value.code == 2


def test_doctor_negative_rtol_is_a_usage_error() -> None:
    # --rtol -1 is accepted and reports a cross-sample dependency for an output that moved by 0.
    from carpool.tools.doctor import main

    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", *FAST_DOCTOR, "--rtol", "-1"])
    assert exit_info.value.code == 2


def test_doctor_unwritable_json_fails_before_measuring(tmp_path: Path) -> None:
    from carpool.tools.doctor import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["numpy:negative", *FAST_DOCTOR, "--json", str(blocker / "out.json")])
    assert exit_info.value.code == 2
