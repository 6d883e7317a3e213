"""Issue 50: two commands never write one folder at once. A second `fit` into a run folder that
another is writing is refused (exit 2, one line naming the setting and the folder) and the first
one's files are kept. A `prepare` or `shard` into a folder that another is building waits for its
turn: it then reuses the build when it is its own config's, and refuses with one line (exit 2,
naming the setting) what another config built meanwhile. A killed writer's lock blocks nobody, and
a killed build leaves no output folder.

The first writer is a second real process holding `flock` on the lock's documented file (inside a
run folder; `.<name>.soma_pl.lock` beside a folder being built), so the refusal or the wait is the
command's own and not a check of this process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from soma_pl.cli import main
from tests.data.corpora import write_jsonl_corpus
from tests.robustness.cli import cli, one_error
from tests.robustness.test_data_safety import listing, prepare_args, shard_args

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/locks")

LOCK = ".soma_pl.lock"
TINY_SPSA = Path(__file__).parents[1] / "lit" / "tiny_spsa.yaml"
HOLD = """
import fcntl, os, sys
handle = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""
"""A writer that holds a lock file until its stdin closes."""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """A corpus and its prepared dataset (tiny_spsa.yaml's settings, so a fit reuses it)."""
    root = tmp_path_factory.mktemp("locked")
    write_jsonl_corpus(root / "corpus", {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    main(prepare_args(root / "corpus", root / "data"))
    return root / "corpus", root / "data"


@pytest.fixture(scope="module")
def sharded(built) -> Path:
    """`built`'s dataset sharded with `shard_args`' settings."""
    experts = built[1].parent / "experts"
    main(shard_args(built[1], experts))
    return experts


def beside(output: Path) -> Path:
    """The lock file of a folder being built."""
    return output.parent / f".{output.name}{LOCK}"


def hidden(folder: Path) -> list[str]:
    """The hidden entries of `folder`: staging folders and lock files."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@contextmanager
def held(lock: Path) -> Iterator[subprocess.Popen]:
    """The lock file `lock` held by another process until the block ends or its stdin closes."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def waited_for(lock: Path) -> bool:
    """Whether a process waits for `flock` on `lock` (a `->` line of /proc/locks for its inode)."""
    inode = f":{lock.stat().st_ino}"
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 5].endswith(inode):
            return True
    return False


def marker(folder: Path) -> int:
    """The inode of the output marker in `folder`: which build wrote it."""
    return (folder / ".soma_pl-output.json").stat().st_ino


def copy(source: Path, output: Path) -> Callable[[], int]:
    """A build of `output` that copies `source` there; it returns the `marker` it wrote."""
    def build() -> int:
        shutil.copytree(source, output)
        return marker(output)
    return build


@contextmanager
def built_meanwhile(output: Path, build: Callable[[], int]) -> Iterator[list[int]]:
    """`output` built by another process, which runs `build` once a command waits for its turn and
    then ends; yields a list that holds what `build` returned once it ran (it never runs if no one
    waits)."""
    ran, done = [], threading.Event()
    with held(beside(output)) as holder:
        def finish() -> None:
            try:
                while not done.is_set() and not waited_for(beside(output)):
                    time.sleep(0.02)
                if not done.is_set():
                    ran.append(build())
            finally:
                holder.stdin.close()

        thread = threading.Thread(target=finish)
        thread.start()
        try:
            yield ran
        finally:
            done.set()
            thread.join(timeout=60)


def test_a_second_prepare_of_the_same_config_waits_and_reuses_the_build(capsys, built, tmp_path):
    corpus, data = built
    output = tmp_path / "data"
    with built_meanwhile(output, copy(data, output)) as ran:
        with pytest.warns(UserWarning, match=re.escape(f"dataset.output_dir={output} ") + ".*waiting"):
            assert cli(capsys, *prepare_args(corpus, output)) == (0, [])
    assert ran == [marker(output)]  # the build it waited for, not rebuilt
    assert listing(output) == listing(data)
    assert hidden(tmp_path) == []  # no staging folder, and the lock file went with the lock


def test_a_second_prepare_refuses_a_dataset_of_another_config_built_while_it_waited(capsys, built, tmp_path):
    corpus, data = built
    output = tmp_path / "data"
    other = prepare_args(corpus, output, "--dataset.seed=5")
    with built_meanwhile(output, copy(data, output)) as ran:
        one_error(cli(capsys, *other), f"dataset.output_dir={output}")
    assert ran == [marker(output)]
    assert listing(output) == listing(data)  # the other command's dataset is kept
    assert hidden(tmp_path) == []
    assert cli(capsys, *other) == (0, [])  # asked again, it replaces it
    assert json.loads((output / "manifest.json").read_text())["seed"] == 5


def test_a_second_shard_of_the_same_config_waits_and_reuses_the_build(capsys, built, sharded, tmp_path):
    output = tmp_path / "experts"
    with built_meanwhile(output, copy(sharded, output)) as ran:
        assert cli(capsys, *shard_args(built[1], output)) == (0, [])
    assert ran == [marker(output)]
    assert listing(output) == listing(sharded)
    assert hidden(tmp_path) == []


def test_a_second_shard_refuses_experts_of_another_config_built_while_it_waited(capsys, built, sharded, tmp_path):
    output = tmp_path / "experts"
    with built_meanwhile(output, copy(sharded, output)) as ran:
        one_error(cli(capsys, *shard_args(built[1], output, "--shard.seed=7")), f"shard.output_dir={output}")
    assert ran == [marker(output)]
    assert listing(output) == listing(sharded)


def test_a_second_fit_into_a_run_folder_being_written_is_refused(capsys, built, tmp_path):
    corpus, data = built
    run = tmp_path / "run"
    run.mkdir()
    with held(run / LOCK):
        (run / "summary.json").write_text("the first run's\n")
        one_error(cli(capsys, "fit", "--config", str(TINY_SPSA), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
                      f"--data.init_args.dataset.output_dir={data}", f"--trainer.default_root_dir={run}",
                      "--trainer.logger=false", "--trainer.max_steps=1"),
                  f"--trainer.default_root_dir={run}")
        assert sorted(p.name for p in run.iterdir()) == [LOCK, "summary.json"]
        assert (run / "summary.json").read_text() == "the first run's\n"


def test_a_second_fit_into_a_checkpoint_folder_being_written_is_refused(capsys, built, tmp_path):
    """Two runs with their own run folders but one `--checkpoint.dirpath` would mix their checkpoints."""
    corpus, data = built
    checkpoints = tmp_path / "shared-checkpoints"
    checkpoints.mkdir()
    with held(checkpoints / LOCK):
        one_error(cli(capsys, "fit", "--config", str(TINY_SPSA), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
                      f"--data.init_args.dataset.output_dir={data}", f"--trainer.default_root_dir={tmp_path / 'run'}",
                      f"--checkpoint.dirpath={checkpoints}", "--trainer.logger=false", "--trainer.max_steps=1"),
                  f"--checkpoint.dirpath={checkpoints}")
        assert sorted(p.name for p in checkpoints.iterdir()) == [LOCK]


def _killed_holder(lock: str, folder: Path) -> None:
    """Run `with <lock>(folder, ...)` in a process, and kill it with SIGKILL while it holds the lock."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path\n"
                              f"from soma_pl.locks import {lock}\n"
                              f"with {lock}(Path(sys.argv[1]), 'dataset.output_dir'):\n"
                              "    print('held', flush=True); sys.stdin.read()", str(folder)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)


def test_a_killed_build_leaves_no_output_folder_and_a_lock_that_blocks_nobody(capsys, built, tmp_path):
    corpus, _ = built
    output = tmp_path / "data"
    _killed_holder("build_lock", output)
    assert not output.exists()
    assert hidden(tmp_path) == [beside(output).name]  # what the killed build left: no data
    assert cli(capsys, *prepare_args(corpus, output)) == (0, [])
    assert json.loads((output / "manifest.json").read_text())["train"]["documents"] > 0
    assert hidden(tmp_path) == []


def test_a_killed_writers_lock_in_its_folder_blocks_nobody(tmp_path):
    from soma_pl.locks import folder_lock

    run = tmp_path / "run"
    _killed_holder("folder_lock", run)
    assert sorted(p.name for p in run.iterdir()) == [LOCK]
    with folder_lock(run, "--trainer.default_root_dir"):
        pass
    assert list(run.iterdir()) == []  # the stale file is removed with the new lock


def test_a_build_waits_for_its_turn_without_making_its_folder(tmp_path):
    from soma_pl.locks import build_lock

    folder = tmp_path / "data"
    with held(beside(folder)) as holder:
        threading.Timer(0.5, holder.stdin.close).start()
        with pytest.warns(UserWarning, match="waiting"), build_lock(folder, "dataset.output_dir"):
            assert holder.wait(timeout=30) == 0  # it holds the folder only once the holder has ended
            assert not folder.exists()
    assert hidden(tmp_path) == []  # the lock's file is removed with the lock


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
    from soma_pl.locks import build_lock, folder_lock

    with folder_lock(tmp_path / "run", "--trainer.default_root_dir"):
        with pytest.raises(ConfigError, match="dataset.output_dir"):
            with build_lock(tmp_path / "run", "dataset.output_dir"):
                pass
