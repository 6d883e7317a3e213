"""Running the real CLI on bad input: it must exit 2 with one line on stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from soma_pl.cli import main
from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from tests.data.corpora import write_jsonl_corpus


def error_line(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2, return the last line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def cli(capsys, *args: str) -> tuple[int, list[str]]:
    """Run the CLI in-process: its exit code and its `soma_pl: error:` lines. Stderr holds no
    traceback nor usage text, and an error line is its last line."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("soma_pl: error:")]
    assert not errors or err.strip().splitlines()[-1] == errors[-1], err[-2000:]
    return code, errors


def one_error(result: tuple[int, list[str]], *fragments: str) -> str:
    """The one error line of an exit-2 run from :func:`cli`, holding each of `fragments`."""
    code, errors = result
    assert code == 2 and len(errors) == 1, result
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


def tiny_dataset(folder: Path) -> tuple[Path, Path]:
    """`(corpus, prepared data)` under `folder`, prepared as tests/lit/tiny_spsa.yaml prepares it
    (so `fit` with that config reuses it)."""
    corpus, data = folder / "corpus", folder / "data"
    write_jsonl_corpus(corpus, {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
    prepare(PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(corpus)]), output_dir=str(data),
                          val_documents=2, val_windows=4, test_windows=4, shard_max_bytes=40000,
                          expert_val_fraction=0.05), progress=False)
    return corpus, data


def dead_pid() -> int:
    """The process id of a process that has exited (and been reaped)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
