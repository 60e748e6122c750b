"""The command line: names, flags and exit statuses are a contract with users' scripts.

Bad input to ``carpool serve``, ``bench`` and ``doctor`` exits 2 with one line, before a
long run, never with a traceback (``carpool tune``'s: tools/test_tune_cli.py)."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carpool import __version__
from carpool.cli import app

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"carpool {__version__}"


def test_serve_keeps_its_flags() -> None:
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("CONFIG", "--host", "--port", "--grpc-port", "--log-level", "--ray-address"):
        assert flag in result.output, flag


def test_ray_address_wins_over_the_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from carpool.cli import _repository

    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr("carpool.server.builder.connect", lambda *args: calls.append(args))
    config = tmp_path / "serve.yaml"
    config.write_text(
        textwrap.dedent("""\
            ray: {address: auto, namespace: serving}
            models:
              - name: m
                kind: python
                source: numpy:copy
                inputs: [{name: X, datatype: FP32, shape: [-1]}]
                outputs: [{name: Y, datatype: FP32, shape: [-1]}]
                executor: ray
            """)
    )
    _repository(str(config), "10.0.0.1:6379")
    _repository(str(config))
    assert calls == [("10.0.0.1:6379", "serving", None), ("auto", "serving", None)]


def test_a_broken_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("models:\n  - name: m\n    kind: python\n    sourc: x:y\n")
    result = runner.invoke(app, ["serve", str(config)])
    assert result.exit_code == 2
    assert "sourc" in result.output


def test_a_model_file_that_fails_to_load_exits_2_with_one_line(tmp_path: Path) -> None:
    # The file is read when the replicas start, after the config was checked.
    (tmp_path / "broken.pt2").write_bytes(b"not a model")
    config = tmp_path / "serve.yaml"
    config.write_text(
        "models:\n  - name: m\n    kind: torch\n    source: broken.pt2\n"
        "    inputs: [{name: x, datatype: FP32, shape: [4]}]\n"
        "    outputs: [{name: y, datatype: FP32, shape: [4]}]\n"
    )
    result = runner.invoke(app, ["serve", str(config), "--port", "0", "--grpc-port", "0"])
    assert result.exit_code == 2
    ours = [line for line in result.output.splitlines() if line.startswith("carpool serve:")]
    assert len(ours) == 1, result.output  # (torch logs its own warning lines about the file)
    assert str(config) in ours[0] and "broken.pt2" in ours[0] and ".pt2 file" in ours[0]
    assert result.output.strip().splitlines()[-1] == ours[0]


def test_without_a_command_it_shows_help() -> None:
    result = runner.invoke(app, [])
    assert "serve" in result.output and "demo" in result.output


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


def test_serve_non_utf8_config_exits_2_without_traceback(tmp_path: Path) -> None:
    # e.g. `carpool serve model.onnx` by mistake: load_config catches OSError only.
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"\x80\x81\xff\x00binary")
    result = runner.invoke(app, ["serve", str(path)])
    assert not isinstance(result.exception, UnicodeDecodeError), result.exception
    assert result.exit_code == 2


def test_serve_unknown_log_level_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(PYTHON_MODEL)
    result = runner.invoke(app, ["serve", str(path), "--log-level", "bogus", "--grpc-port", "0"])
    assert not isinstance(result.exception, KeyError), repr(result.exception)
    assert result.exit_code == 2


def test_serve_a_body_timeout_it_cannot_take_exits_2_naming_the_flag_before_any_model(
    tmp_path: Path,
) -> None:
    """Was: refused only after the models loaded, as "serve.yaml: invalid body_timeout_s"."""
    path = tmp_path / "serve.yaml"
    path.write_text(PYTHON_MODEL.replace("numpy:negative", "no_such_module_anywhere:fn"))
    result = runner.invoke(app, ["serve", str(path), "--body-timeout-s", "inf"])
    assert result.exit_code == 2
    assert "invalid --body-timeout-s=inf" in result.output
    assert "serve.yaml" not in result.output and "no_such_module" not in result.output


@pytest.mark.parametrize("host", ["not_a_host.invalid", "999.1.1.1"])
def test_serve_a_host_that_does_not_resolve_exits_2_naming_the_flag(
    tmp_path: Path, host: str
) -> None:
    """Was: exit 3, the status of a port already taken."""
    path = tmp_path / "serve.yaml"
    path.write_text(PYTHON_MODEL)
    result = runner.invoke(app, ["serve", str(path), "--host", host, "--grpc-port", "0"])
    assert result.exit_code == 2
    assert f"invalid --host={host!r}" in result.output


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
