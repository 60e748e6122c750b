"""``carpool trace``'s own checks (carpool.tools.trace); recording a real server is
tests/integration/test_trace_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.tools.trace import main, trace_document


@pytest.mark.parametrize("seconds", ["0", "-1", "301", "nan"])
def test_seconds_out_of_range_exit_2_before_asking_the_server(
    seconds: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["http://127.0.0.1:1", "--seconds", seconds, "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2
    assert "carpool trace: " in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_an_out_path_that_is_a_folder_exits_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2


def test_the_document_keeps_what_the_server_said() -> None:
    served = {
        "clock": "monotonic", "unix_offset_s": 5.0, "seconds": 2.0, "num_dropped": 3,
        "timelines": [],
    }  # fmt: skip
    document = trace_document(served, "http://h:1")
    assert document["traceEvents"] == []
    assert document["otherData"] == {
        "source": "carpool trace", "url": "http://h:1", "seconds": 2.0, "num_requests": 0,
        "num_dropped": 3, "unix_offset_s": 5.0,
    }  # fmt: skip
