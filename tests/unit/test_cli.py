"""The command line: names and flags are a contract with users' scripts."""

from __future__ import annotations

from pathlib import Path

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
    for flag in ("CONFIG", "--host", "--port", "--grpc-port", "--log-level"):
        assert flag in result.output, flag


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
