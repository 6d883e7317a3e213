"""Fit a multi-process pinned run: `python -m tests.pinned.ddpp NAME FOLDER OUT`.

Lightning's DDP strategy starts the other ranks by running this same command again; every rank
reads the same batches, and rank 0 writes what it logged to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.pinned.runs import RUNS, RecordLosses, build, one_thread, trainer


def main(name: str, folder: str, out: str) -> None:
    one_thread()
    module, data = build(name, Path(folder))
    record = RecordLosses()
    fitting = trainer([record], processes=RUNS[name].processes)
    fitting.fit(module, data)
    if fitting.is_global_zero:
        Path(out).write_text(json.dumps({"train": record.train, "val": record.val}))


if __name__ == "__main__":
    main(*sys.argv[1:])
