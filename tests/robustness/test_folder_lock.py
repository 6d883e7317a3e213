"""Issue 50: a second command writing a folder that another is writing is refused (exit 2, one line
naming the setting and the folder), and the first one's files are kept; a killed writer's lock
blocks nobody.

The first writer is a second real process holding `flock` on `.soma_pl.lock` in the folder, the
lock's documented file, so the refusal is the command's own and not a check of this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from soma_pl.cli import main
from tests.data.corpora import write_jsonl_corpus
from tests.robustness.cli import cli, one_error
from tests.robustness.test_data_safety import listing, prepare_args, shard_args

LOCK = ".soma_pl.lock"
TINY_SPSA = Path(__file__).parents[1] / "lit" / "tiny_spsa.yaml"
HOLD = """
import fcntl, os, sys
handle = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""
"""A writer that holds the folder until its stdin closes."""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """A corpus and its prepared dataset (tiny_spsa.yaml's settings, so a fit reuses it)."""
    root = tmp_path_factory.mktemp("locked")
    write_jsonl_corpus(root / "corpus", {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    main(prepare_args(root / "corpus", root / "data"))
    return root / "corpus", root / "data"


@contextmanager
def held(folder: Path) -> Iterator[subprocess.Popen]:
    """`folder` (made if missing) held by another process until the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder / LOCK)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_second_prepare_into_a_folder_being_written_is_refused(capsys, built, tmp_path):
    corpus, data = built
    output = tmp_path / "data"
    main(prepare_args(corpus, output))
    rebuild = prepare_args(corpus, output, "--dataset.seed=5")
    with held(output):
        before = listing(output)
        one_error(cli(capsys, *rebuild), f"dataset.output_dir={output}")
        assert listing(output) == before
    assert cli(capsys, *rebuild) == (0, [])  # the writer has ended: its lock file is no data
    assert json.loads((output / "manifest.json").read_text())["seed"] == 5


def test_a_second_shard_into_a_folder_being_written_is_refused(capsys, built, tmp_path):
    _, data = built
    output = tmp_path / "experts"
    with held(output):
        one_error(cli(capsys, *shard_args(data, output)), f"shard.output_dir={output}")
        assert sorted(p.name for p in output.iterdir()) == [LOCK]
    assert cli(capsys, *shard_args(data, output)) == (0, [])
    assert (output / "experts.json").is_file()


def test_a_second_fit_into_a_run_folder_being_written_is_refused(capsys, built, tmp_path):
    corpus, data = built
    run = tmp_path / "run"
    with held(run):
        (run / "summary.json").write_text("the first run's\n")
        one_error(cli(capsys, "fit", "--config", str(TINY_SPSA), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
                      f"--data.init_args.dataset.output_dir={data}", f"--trainer.default_root_dir={run}",
                      "--trainer.logger=false", "--trainer.max_steps=1"),
                  f"--trainer.default_root_dir={run}")
        assert sorted(p.name for p in run.iterdir()) == [LOCK, "summary.json"]
        assert (run / "summary.json").read_text() == "the first run's\n"


def test_a_killed_writer_leaves_a_lock_that_blocks_nobody(capsys, built, tmp_path):
    corpus, _ = built
    output = tmp_path / "data"
    child = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path\n"
                              "from soma_pl.io import folder_lock\n"
                              "with folder_lock(Path(sys.argv[1]), 'dataset.output_dir'):\n"
                              "    print('held', flush=True); sys.stdin.read()", str(output)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert sorted(p.name for p in output.iterdir()) == [LOCK]  # what the killed writer left: no data
    assert cli(capsys, *prepare_args(corpus, output)) == (0, [])
    marker = json.loads((output / ".soma_pl-output.json").read_text())
    assert "manifest.json" in marker["files"] and LOCK not in marker["files"]
    assert not (output / LOCK).exists()


def test_fits_preparing_one_dataset_take_turns_instead(tmp_path):
    from soma_pl.io import folder_lock

    folder = tmp_path / "data"
    with held(folder) as holder:
        threading.Timer(0.5, holder.stdin.close).start()
        with folder_lock(folder, "dataset.output_dir", wait=True):
            assert holder.wait(timeout=30) == 0  # it holds the folder only once the holder has ended
        assert list(folder.iterdir()) == []  # the lock's file is removed with the lock


@pytest.mark.parametrize("environment, launching", [
    ({}, True), ({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}, True), ({"SLURM_PROCID": "0"}, True),
    ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, False), ({"NODE_RANK": "1"}, False), ({"RANK": "3"}, False),
    ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, False), ({"SLURM_PROCID": "2"}, False)])
def test_only_the_launching_process_of_a_run_holds_its_folder(monkeypatch, environment, launching):
    from soma_pl.distributed import RANK_VARIABLES, launching_process

    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert launching_process() is launching


def test_a_folder_this_command_already_holds_is_refused_not_waited_for(tmp_path):
    from soma_pl.errors import ConfigError
    from soma_pl.io import folder_lock

    with folder_lock(tmp_path / "run", "--trainer.default_root_dir"):
        with pytest.raises(ConfigError, match="dataset.output_dir"):
            with folder_lock(tmp_path / "run", "dataset.output_dir", wait=True):
                pass
