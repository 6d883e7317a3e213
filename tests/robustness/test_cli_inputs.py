"""Issue 30, the command line: config layers in the wrong order, one run per checkpoint folder,
`--ckpt_path last` after a kill between two checkpoint writes, a demo whose children die with it,
sweep study names that are names, and one line (exit 2) for bad trainer settings, config files,
sweep files and counts.

Every bad input runs the real CLI in-process and expects exit status 2, one `soma_pl: error:` line
and no traceback or usage text; the demo runs in a child process so that it can be killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from soma_pl.cli import main
from soma_pl.config_files import config_args, read_layer
from soma_pl.errors import DataError
from soma_pl.io import machine
from soma_pl.lightning_cli import make_cli
from soma_pl.trainer_checks import resume_point
from tests.lit.conftest import fit_args
from tests.robustness.cli import cli, dead_pid, one_error
from tests.sweeps.conftest import write_sweep

ROOT = Path(__file__).resolve().parents[2]
TRAINER, DATA, METHOD = (ROOT / "configs" / "trainer" / "cpu.yaml", ROOT / "configs" / "datamodule" / "demo.yaml",
                         ROOT / "configs" / "demo" / "spsa.yaml")


def _layers(*paths: Path) -> list[str]:
    return config_args(paths)


# --- 8: config layers in the wrong order ------------------------------------------------------------


def test_a_base_layer_after_the_method_layer_warns_naming_what_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    method = read_layer(METHOD).settings  # without its `base:`: the test gives the layers itself
    method["data"]["init_args"]["batch_size"] = 2
    layer = tmp_path / "method.yaml"
    layer.write_text(yaml.safe_dump(method))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reversed_order = make_cli(_layers(layer, DATA, TRAINER), run=False)
        in_order = make_cli(_layers(TRAINER, DATA, layer), run=False)
    assert (reversed_order.datamodule.batch_size, in_order.datamodule.batch_size) == (8, 2)
    (message,) = [str(w.message) for w in caught if "method layer" in str(w.message)]  # the reversed run's only
    assert message.startswith(f"--config {DATA} comes after the method layer {layer} and changes its ")
    assert "data.init_args.batch_size=2 → 8" in message and "\n" not in message


# --- 9: one run per checkpoint folder; `--ckpt_path last` resumes the newest checkpoint -----------------


def test_a_new_fit_refuses_a_folder_holding_an_earlier_runs_checkpoints(dataset, four_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    before = sorted(path.name for path in (run / "checkpoints").iterdir())
    one_error(cli(capsys, *fit_args(*dataset, run, "--trainer.max_steps=8")),
              f"checkpoint folder {run / 'checkpoints'} holds an earlier run's checkpoints", "--ckpt_path last")
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == before == ["epoch=0-step=4.ckpt",
                                                                                       "last.ckpt"]


def test_last_resumes_an_epoch_checkpoint_written_after_last_ckpt_and_leaves_no_stale_copy(dataset, tmp_path):
    """A run killed after its first `epoch=…` checkpoint and before `last.ckpt`: Lightning's `last`
    finds no `last*.ckpt` and trains from scratch beside the old checkpoint."""
    run = tmp_path / "run"
    main(fit_args(*dataset, run, "--trainer.max_steps=4"))
    (run / "checkpoints" / "last.ckpt").unlink()
    with pytest.warns(UserWarning, match=r"--ckpt_path last: resuming from epoch=0-step=4\.ckpt, the latest state"):
        main(fit_args(*dataset, run, "--trainer.max_steps=8", "--ckpt_path=last"))
    folder = run / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    straight = tmp_path / "straight"
    main(fit_args(*dataset, straight, "--trainer.max_steps=8"))
    resumed, expected = (torch.load(path / "checkpoints" / "last.ckpt", weights_only=False) for path in (run, straight))
    assert resumed["global_step"] == expected["global_step"] == 8
    assert all(torch.equal(resumed["state_dict"][name], tensor) for name, tensor in expected["state_dict"].items())


def test_last_takes_the_highest_recorded_step_not_the_newest_file(dataset, four_steps, tmp_path):
    """A `cp -r` scrambles modification times: an older state with the newest time must not be
    resumed over the latest one (which Lightning would then retrain and overwrite)."""
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    main(fit_args(*dataset, run, "--trainer.max_steps=8", "--ckpt_path=last"))
    folder = run / "checkpoints"
    shutil.copyfile(four_steps / "checkpoints" / "epoch=0-step=4.ckpt", folder / "epoch=0-step=4.ckpt")
    for name in ("last.ckpt", "epoch=0-step=8.ckpt"):
        os.utime(folder / name, ns=(1, 1))  # older than the step-4 copy
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # last.ckpt is the latest state: nothing is relinked
        assert resume_point(folder) == folder / "last.ckpt"
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 8
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_last_removes_what_a_killed_writer_left_even_when_nothing_more_is_trained(four_steps, tmp_path):
    """Killed while writing `last.ckpt` after `epoch=0-step=4.ckpt`: a resume to step 4 promotes that
    file and trains nothing, so no save would remove the dead process's temporary file."""
    folder = tmp_path / "checkpoints"
    shutil.copytree(four_steps / "checkpoints", folder)
    (folder / "last.ckpt").unlink()
    stale = folder / f".last.ckpt.tmp-{machine()}-{dead_pid()}"
    stale.write_bytes(b"partial")
    with pytest.warns(UserWarning, match="epoch=0-step=4.ckpt"):
        assert resume_point(folder) == folder / "last.ckpt"
    assert not stale.exists() and sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=4.ckpt",
                                                                                     "last.ckpt"]


def test_last_refuses_an_unreadable_checkpoint_naming_it(four_steps, tmp_path):
    folder = tmp_path / "checkpoints"
    shutil.copytree(four_steps / "checkpoints", folder)
    (folder / "epoch=0-step=9.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="epoch=0-step=9.ckpt"):
        resume_point(folder)


# --- 14, 15: one line for bad trainer settings and config files ----------------------------------


def _bad_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.yaml"
    content = {"latin-1": "trainer:\n  max_steps: 3  # caf\xe9\n".encode("latin-1"),
               "unknown key": b"trainer:\n  bogus_key: 1\n",
               "empty": b"",
               "python tag": f'trainer: !!python/object/apply:os.system ["touch {tmp_path / "ran"}"]\n'.encode()}
    path.write_bytes(content[kind])
    return path


@pytest.mark.parametrize("args, fragments", [
    (["--trainer.max_steps=-5"], ["--trainer.max_steps=-5: ", "or -1 for no limit"]),
    (["--trainer.val_check_interval=0"], ["--trainer.val_check_interval=0: ", "integer ≥ 1"]),
    (["--trainer.val_check_interval=-3"], ["--trainer.val_check_interval=-3: ", "integer ≥ 1"]),
    (["--trainer.val_check_interval=0.5"], ["--trainer.val_check_interval=0.5: a fraction of an epoch"]),
    (["--trainer.bogus=1"], ["fit: unrecognized arguments: --trainer.bogus=1", "`python -m soma_pl.cli fit --help`"]),
    (["--trainer.max_steps=many"], ["fit: trainer.max_steps: Expected a <class 'int'>. Got value: many", "--help"]),
    (["--model.init_args.spsa.eps=abc"], ["fit: model.init_args.spsa.eps: Expected a <class 'float'>", "--help"]),
    (["--model.class_path=nowhere.Module"], ["fit: model: Problem with given class_path 'nowhere.Module'", "--help"]),
], ids=lambda value: value[0] if isinstance(value, list) and value[0].startswith("--") else None)
def test_bad_settings_of_fit_are_one_line(args, fragments, dataset, tmp_path, capsys):
    one_error(cli(capsys, *fit_args(*dataset, tmp_path / "run", *args)), *fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_a_gpu_accelerator_without_a_gpu_is_one_line(dataset, tmp_path, capsys):
    one_error(cli(capsys, *fit_args(*dataset, tmp_path / "run", "--trainer.accelerator=gpu")),
              "--trainer.accelerator=gpu: no CUDA GPU is visible", "--trainer.accelerator=cpu")


@pytest.mark.parametrize("under", [False, True], ids=["is a file", "under a file"])
def test_a_run_folder_that_is_or_lies_under_a_file_is_one_line(under, dataset, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    root = file / "run" if under else file
    where = f"lies under the file {file}" if under else "is a file"
    one_error(cli(capsys, *fit_args(*dataset, root)), f"--trainer.default_root_dir={root} {where}")
    assert file.read_text() == "mine"


@pytest.mark.parametrize("kind, fragments", [
    ("latin-1", ["is not UTF-8 text (byte 0xe9 on line 2): save it as UTF-8"]),
    ("unknown key", ["fit: Subcommand 'fit' does not accept option 'trainer.bogus_key', set in ", "--help"]),
    ("empty", ["is empty: give a YAML mapping of settings"]),
    ("python tag", ["is not valid YAML: could not determine a constructor for the tag",
                    "python/object/apply:os.system' at line 1, column 10", "no `!!python/...` tags"]),
])
def test_a_bad_config_file_is_one_line_naming_it(kind, fragments, dataset, tmp_path, capsys):
    config = _bad_file(tmp_path, kind)
    line = one_error(cli(capsys, *fit_args(*dataset, tmp_path / "run", "--config", str(config))), *fragments)
    assert str(config) in line and not (tmp_path / "ran").exists()


# --- 12, 14, 16: sweeps and the demo -------------------------------------------------------------


def test_a_study_name_climbing_out_of_the_output_folder_is_refused(tmp_path, capsys):
    sweep = write_sweep(tmp_path, study="../../../escaped")
    one_error(cli(capsys, "sweep", "--sweep", str(sweep), "--n_trials=1", "--progress=false"),
              "study '../../../escaped' is not a name", "no `/` or `..`")
    assert not list(tmp_path.parent.rglob("*escaped*")) and not (tmp_path / "out").exists()


def test_a_sweep_file_that_is_not_yaml_is_one_line(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("study: broken\ngrid: [unclosed\n  : : :\n")
    one_error(cli(capsys, "sweep", "--sweep", str(sweep)),
              f"sweep file {sweep} is not valid YAML: expected ',' or ']', but got ':' at line 3, column 3")


@pytest.mark.parametrize("count", [0, -1])
def test_a_sweep_worker_needs_at_least_one_trial(count, tmp_path, capsys):
    one_error(cli(capsys, "sweep", "--sweep", str(write_sweep(tmp_path)), f"--n_trials={count}"),
              f"--n_trials={count}: give how many trials this worker may run (1 or more)")
    assert not (tmp_path / "out").exists()


def test_a_report_on_a_file_that_is_no_database_is_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database\n" * 100)
    one_error(cli(capsys, "sweep", "report", "--sweep", str(write_sweep(tmp_path)), f"--storage=sqlite:///{garbage}",
                  f"--out={tmp_path / 'report.json'}"),
              f"--storage sqlite:///{garbage}: cannot open the database", "file is not a database")
    assert garbage.read_bytes() == b"not a database\n" * 100 and not (tmp_path / "report.json").exists()


def test_demo_workers_must_be_at_least_one(tmp_path, capsys):
    one_error(cli(capsys, "demo", "--workers=0", f"--results={tmp_path / 'out'}", "--progress=false"), "--workers=0")
    assert not (tmp_path / "out").exists()


# --- 11: the demo's children die with it; Ctrl-C is one line ------------------------------------------

FAKE_STEP = """
import os, sys, time
marks, command = sys.argv[1], sys.argv[2]
open(os.path.join(marks, f"{command}-{os.getpid()}"), "w").close()
time.sleep(300 if command == "fit" else 0)
"""
"""A demo step: records that it started (`<command>-<pid>`); a fit (the first: a seed's) then runs for minutes."""

DEMO = """
import subprocess, sys
fake, marks, out = sys.argv[1:4]
real = subprocess.Popen.__init__

def step(self, args, *rest, **kwargs):  # every `python -m soma_pl.cli <command> ...` runs FAKE_STEP
    if list(args[1:3]) == ["-m", "soma_pl.cli"]:
        args = [args[0], "-c", fake, marks, *args[3:]]
    real(self, args, *rest, **kwargs)

subprocess.Popen.__init__ = step
from soma_pl.cli import main
main(["demo", f"--results={out}", "--progress=false"])
"""
"""The real `demo` command in a process of its own, its steps replaced by FAKE_STEP."""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # an orphan's zombie waits for a reaper, it runs nothing


def _demo_with_a_fit(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    marks = tmp_path / "marks"
    marks.mkdir()
    demo = subprocess.Popen([sys.executable, "-c", DEMO, FAKE_STEP, str(marks), str(tmp_path / "out")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (fits := [int(p.name.split("-")[1]) for p in marks.glob("fit-*")]) and demo.poll() is None:
        assert time.monotonic() < deadline, "the demo's first fit never started"
        time.sleep(0.1)
    assert demo.poll() is None, demo.stderr.read()
    return demo, fits


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


def _end(demo: subprocess.Popen, pids: list[int]) -> None:
    """Clean up after a failed test: the demo and the fit steps this test started."""
    for pid in [demo.pid, *pids]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    demo.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_demos_fits_die_when_the_demo_is_killed(tmp_path):
    demo, fits = _demo_with_a_fit(tmp_path)
    try:
        demo.send_signal(signal.SIGKILL)
        demo.wait()
        assert _gone(fits, 10), "a fit kept running after the demo was killed"
    finally:
        _end(demo, fits)


def test_ctrl_c_stops_the_demo_and_its_fits_with_one_line(tmp_path):
    demo, fits = _demo_with_a_fit(tmp_path)
    try:
        demo.send_signal(signal.SIGINT)  # the demo alone: its children must be stopped by it
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 130 and err.strip().splitlines()[-1] == "soma_pl: interrupted", err[-2000:]
        assert "Traceback" not in err and _gone(fits, 10)
    finally:
        _end(demo, fits)
