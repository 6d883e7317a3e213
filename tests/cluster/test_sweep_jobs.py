"""`sbatch scripts/slurm/sweep.sbatch`: a SLURM job array of 2 sweep workers on one PostgreSQL study
(Optuna's RDBStorage with its heartbeat) runs every grid point to completion exactly once; a worker
cancelled with `scancel` in the middle of a trial loses nothing, since the other worker runs that
point again."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml

from tests.cluster.slurm import cancel, submit, wait, wait_for
from tests.robustness.cli import tiny_dataset

pytestmark = pytest.mark.cluster

TINY = Path(__file__).resolve().parents[1] / "lit" / "tiny_spsa.yaml"
RATES = [0.05, 0.1, 0.15]
STUDY = "cluster_sweep"


def write_sweep(folder: Path) -> Path:
    corpus, data = tiny_dataset(folder)  # prepared before the workers start, as docs/distributed.md asks
    content = {"study": STUDY, "config": str(TINY), "output_dir": str(folder / "out"), "seeds": [0],
               "grid": {"lr": {"key": "model.init_args.optimizer.init_args.lr", "values": RATES}},
               "overrides": {"data.init_args.dataset.corpus.paths": [str(corpus)],
                             "data.init_args.dataset.output_dir": str(data), "trainer.logger": False},
               "report": {"columns": "lr"}, "heartbeat_seconds": 1, "stale_seconds": 10, "wandb": False}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(content))
    return path


def trials(url: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=STUDY, storage=url).get_trials(deepcopy=False)
    except KeyError:  # no worker has created the study yet
        return []


def running(url: str) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials(url) if t.state is optuna.trial.TrialState.RUNNING]


def rate(trial: optuna.trial.FrozenTrial) -> float:
    return trial.params["lr"] if "lr" in trial.params else float(trial.system_attrs["fixed_params"]["lr"])


def test_a_job_array_of_two_workers_on_postgresql_completes_every_point_once_when_one_is_cancelled(
        slurm, postgres_url, tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = write_sweep(tmp_path)
    job = submit("sweep.sbatch", "--sweep", str(sweep), "--storage", postgres_url,
                 output=tmp_path / "slurm-%A_%a.out")
    busy = wait_for(lambda: len(running(postgres_url)) == 2 and running(postgres_url), 300,
                    "both workers running a trial")
    assert cancel(f"{job}_0") == "CANCELLED"
    assert wait(job, 900) == "CANCELLED,COMPLETED", [p.read_text()[-2000:] for p in tmp_path.glob("slurm-*.out")]

    final = trials(postgres_url)
    complete = [t for t in final if t.state is optuna.trial.TrialState.COMPLETE]
    failed = [t for t in final if t.state is optuna.trial.TrialState.FAIL]
    assert sorted(rate(t) for t in complete) == RATES, [(t.number, t.state, t.params) for t in final]
    for trial in complete:  # each ran its whole fit: the study's value is the one its trial folder records
        result = json.loads((tmp_path / "out" / f"trial-{trial.number:04d}" / "trial_result.json").read_text())
        assert result["global_step"] == 12 and trial.value == result["val_loss"], (trial.number, result)
    # The cancelled worker's trial was failed (stopped, or stale by its heartbeat) and its point ran again.
    assert len(failed) == 1 and len(final) == len(RATES) + 1, [(t.number, t.state, t.params) for t in final]
    assert failed[0].number in {t.number for t in busy}
    assert rate(failed[0]) in RATES
