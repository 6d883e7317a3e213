"""Issue 50: how a `fit` ends. A signal stops it after its current update with one line, exit status
128 + the signal's number, the state resumable and no `summary.json`; a `fast_dev_run` leaves no
checkpoint behind; a resumed run keeps its settings; and settings that Lightning, W&B or the
machine's memory refuse deep into a run are one line (exit 2) before any update.

Bad input runs the real CLI in-process; the signals go to a real child process.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from soma_pl.callbacks import memory
from soma_pl.cli import main
from tests.lit.conftest import fit_args
from tests.robustness.cli import cli, one_error

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _checkpoints(run: Path) -> list[str]:
    folder = run / "checkpoints"
    return sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []


# --- 4: SIGINT and SIGTERM -----------------------------------------------------------------------


def _stopped_by(signum: signal.Signals, corpus: Path, data: Path, run: Path) -> subprocess.CompletedProcess:
    """A fit of (nearly) endless updates in a child process, sent `signum` once its first validation
    has written a checkpoint; its exit status and output."""
    args = fit_args(corpus, data, run, "--trainer.max_steps=100000")
    child = subprocess.Popen([sys.executable, "-m", "soma_pl.cli", *args], cwd=ROOT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "last.ckpt").is_file() and child.poll() is None:
            assert time.monotonic() < deadline, "the fit wrote no checkpoint"
            time.sleep(0.02)
        child.send_signal(signum)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_ends_fit_after_its_update_with_one_line_and_the_state_to_resume(signum, dataset, tmp_path):
    run = tmp_path / "stopped"
    stopped = _stopped_by(signum, *dataset, run)
    lines = stopped.stderr.strip().splitlines()
    assert stopped.returncode == 128 + signum, stopped.stderr[-2000:]
    assert lines[-1].startswith("soma_pl: interrupted") and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    assert not (run / "summary.json").exists()  # a summary marks a finished fit
    step = _load(run / "checkpoints" / "last.ckpt")["global_step"]
    assert 4 <= step < 100000 and str(step) in lines[-1]  # the line says which state it saved

    # The saved state goes on as an uninterrupted run would: the same weights two updates later.
    main(fit_args(*dataset, run, f"--trainer.max_steps={step + 2}", "--ckpt_path=last"))
    main(fit_args(*dataset, tmp_path / "straight", f"--trainer.max_steps={step + 2}"))
    resumed, straight = (_load(tmp_path / name / "checkpoints" / "last.ckpt") for name in ("stopped", "straight"))
    assert resumed["global_step"] == straight["global_step"] == step + 2
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), name


# --- 6: a resumed run keeps its settings ------------------------------------------------------------


@pytest.mark.parametrize("setting", ["--model.init_args.optimizer.init_args.lr=0.5", "--data.init_args.batch_size=2"])
def test_resuming_with_another_setting_is_refused_naming_it(setting, dataset, four_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    before = (run / "config.yaml").read_bytes()
    key = setting[2:].split("=")[0]
    one_error(cli(capsys, *fit_args(*dataset, run, "--trainer.max_steps=8", setting, "--ckpt_path=last")), key)
    assert (run / "config.yaml").read_bytes() == before
    assert _load(run / "checkpoints" / "last.ckpt")["global_step"] == 4


def test_resuming_for_longer_elsewhere_and_in_smaller_pieces_is_allowed(dataset, four_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    allowed = ["--trainer.max_steps=6", "--trainer.val_check_interval=2", "--trainer.logger=false",
               "--trainer.devices=1", "--model.init_args.shape.time_chunk=8", "--model.init_args.spsa.max_rows=4",
               "--data.init_args.eval_batch_size=4", "--ckpt_path=last"]
    assert cli(capsys, *fit_args(*dataset, run, *allowed)) == (0, [])
    assert _load(run / "checkpoints" / "last.ckpt")["global_step"] == 6


# --- 8: fast_dev_run -------------------------------------------------------------------------------


def test_fast_dev_run_leaves_no_checkpoint_and_the_real_fit_starts_after_it(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(capsys, *fit_args(*dataset, run, "--trainer.fast_dev_run=2")) == (0, [])
    assert not _checkpoints(run)
    assert cli(capsys, *fit_args(*dataset, run, "--trainer.max_steps=2")) == (0, [])
    assert _load(run / "checkpoints" / "last.ckpt")["global_step"] == 2


# --- tracebacks and kills: one line, exit 2, before any update --------------------------------------


def test_keeping_the_top_k_checkpoints_without_a_metric_is_one_line(dataset, tmp_path, capsys):
    one_error(cli(capsys, *fit_args(*dataset, tmp_path / "run", "--checkpoint.save_top_k=3")), "--checkpoint",
              "save_top_k=3")


@pytest.mark.parametrize("mode", ["bogus", "online"])
def test_a_wandb_mode_that_cannot_log_is_one_line_before_any_work(mode, dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no account anywhere W&B looks for one
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    run = tmp_path / "run"
    one_error(cli(capsys, *fit_args(*dataset, run, "--trainer.logger=true")), f"WANDB_MODE={mode}")
    assert not run.exists()


def _available(kib: int, tmp_path: Path, monkeypatch) -> None:
    """The machine's available memory, as /proc/meminfo would give it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {2 * kib} kB\nMemAvailable:   {kib} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", meminfo)


def test_an_update_that_cannot_fit_in_memory_is_refused_before_it_runs(dataset, tmp_path, capsys, monkeypatch):
    _available(8 * 2**20, tmp_path, monkeypatch)  # 8 GiB; 10⁹ directions would grow past it until killed
    run = tmp_path / "run"
    one_error(cli(capsys, *fit_args(*dataset, run, "--model.init_args.spsa.n_pert=1000000000")),
              "model.init_args.spsa.n_pert=1000000000")
    assert not _checkpoints(run)


@pytest.mark.parametrize(("kib", "code"), [(214, 2), (215, 0)])
def test_the_memory_bound_is_the_copies_and_activations_of_one_loss_call(kib, code, dataset, tmp_path, capsys,
                                                                         monkeypatch):
    """tiny_spsa.yaml's update: 4 directions per loss call hold 12 copies of the 3,096 perturbed
    float32 weights (head 256·8, gains 3·8, w_ih, w_hh, mlp_in and mlp_out 32·8 each) and the gates
    of 2·4·2 windows over 24 steps (4·8 floats each): 197,760 bytes, refused above 90% of what is
    available."""
    need = 12 * 3096 * 4 + 16 * 24 * 4 * 8 * 4
    assert (need > 0.9 * kib * 1024) == (code == 2)
    _available(kib, tmp_path, monkeypatch)
    result = cli(capsys, *fit_args(*dataset, tmp_path / "run", "--trainer.max_steps=1"))
    if code == 0:
        assert result == (0, [])
    else:
        one_error(result, "model.init_args.spsa.n_pert=4")


def _cgroup(tmp_path: Path, monkeypatch, line: str, files: dict[str, str]) -> None:
    """This process's cgroup as /proc/self/cgroup names it (`line`), and its files under the mount."""
    (tmp_path / "cgroup").write_text(line + "\n")
    for name, text in files.items():
        (tmp_path / "mount" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "mount" / name).write_text(text + "\n")
    monkeypatch.setattr(memory, "CGROUPS", tmp_path / "cgroup")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "mount")


@pytest.mark.parametrize(("line", "files", "headroom"), [
    ("0::/job", {"job/memory.max": "1073741824", "job/memory.current": "268435456"}, 805306368),  # v2
    ("0::/job", {"memory.max": "1000", "memory.current": "400"}, 600),  # v2 in a cgroup namespace
    ("0::/job", {"job/memory.max": "max", "job/memory.current": "268435456"}, None),
    ("4:memory:/job", {"memory/job/memory.limit_in_bytes": "2048", "memory/job/memory.usage_in_bytes": "4096"}, 0),
    ("4:memory:/job", {"memory/job/memory.limit_in_bytes": "9223372036854771712",
                       "memory/job/memory.usage_in_bytes": "10"}, None),  # v1 without a limit
    ("3:cpu:/job", {}, None)])
def test_the_cgroup_headroom_is_its_limit_less_its_usage(line, files, headroom, tmp_path, monkeypatch):
    _cgroup(tmp_path, monkeypatch, line, files)
    assert memory.cgroup_headroom() == headroom


def test_an_update_beyond_the_cgroups_limit_is_refused_though_the_machine_has_room(dataset, tmp_path, capsys,
                                                                                     monkeypatch):
    """A container's or batch job's memory limit kills a process long before the machine runs out:
    tiny_spsa.yaml's update (197,760 bytes) against 214 KiB left in the cgroup of a machine with 8 GiB."""
    _available(8 * 2**20, tmp_path, monkeypatch)
    _cgroup(tmp_path, monkeypatch, "0::/job", {"job/memory.max": str(1000 * 2**20),
                                               "job/memory.current": str(1000 * 2**20 - 214 * 1024)})
    one_error(cli(capsys, *fit_args(*dataset, tmp_path / "run", "--trainer.max_steps=1")),
              "model.init_args.spsa.n_pert=4")
