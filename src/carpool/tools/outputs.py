"""Output files of the tools (``--json``, ``--csv``, ``--out``, ...), checked before a run.

A bench, tune or doctor run can take minutes; a path that cannot be written must fail
at once, naming its flag, not with a traceback once the results exist.
"""

from __future__ import annotations

import os
from pathlib import Path

from carpool.errors import ConfigError


def writable_path(flag: str, value: str | Path | None) -> Path | None:
    """``value`` as a path whose file can be written (its folder is created).

    Raises:
        ConfigError: naming ``flag``, when the folder cannot be made or written, or the
            path is a folder.
    """
    if value is None or value == "":
        return None
    path = Path(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            flag, str(value), f"a file in a folder that can be made ({error.strerror})"
        ) from None
    if path.is_dir():
        raise ConfigError(flag, str(value), "a file path, not a folder")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(flag, str(value), "a file that can be written")
    return path
