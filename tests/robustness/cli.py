"""Running the real CLI on bad input: it must exit 2 with one line on stderr."""

from __future__ import annotations

import pytest

from soma_pl.cli import main


def error_line(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2, return the last line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]
