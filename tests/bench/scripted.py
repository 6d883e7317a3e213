"""A scripted stand-in for the subprocess a `bench prepare`/`bench shard` round times."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def scripted_run(option: str, record_name: str, record: dict, seconds: float) -> Callable[[list[str], str], float]:
    """A `timed(command, failure)` that writes `record` as `<the --option folder>/<record_name>` (what the
    real command would leave there) and reports `seconds` of wall time."""

    def timed(command: list[str], failure: str) -> float:
        (output,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{option}=")]
        Path(output).mkdir()
        (Path(output) / record_name).write_text(json.dumps(record))
        return seconds

    return timed
