"""`carpool demo`'s flags: a value it cannot run is a usage error (exit 2) naming the flag,
before the model is built or a run starts."""

from __future__ import annotations

import pytest

from carpool.tools.demo import main


@pytest.mark.parametrize(
    "argv",
    [
        ["--clients", "0"],  # was both runs, then ZeroDivisionError
        ["--duration-s", "-1"],  # the same
        ["--duration-s", "nan"],
        ["--max-delay-s", "-1"],  # was a ConfigError traceback
    ],
)
def test_a_flag_the_demo_cannot_run_exits_2_naming_it(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err
