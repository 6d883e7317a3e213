"""Compute accounting (Table 3) and compute budgets: closed-form figures, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from soma_pl.callbacks.compute import ComputeAccounting, ComputeBudget, NewRecord, Tally, compute_report
from soma_pl.contracts import UpdateClock, UpdateRecord
from soma_pl.distributed import Accounting
from soma_pl.errors import ConfigError
from tests.lit.conftest import fit_args, run_cli

# tiny_spsa.yaml: 2 · n_pert 4 · 1 expert · 4 windows · 24 predicted bytes per update
FORWARDS_PER_UPDATE = 2 * 4 * 1 * 4 * 24
SECONDS = 0.25  # the patched update clock


@pytest.fixture
def fixed_clock(monkeypatch):
    """Every update takes exactly `SECONDS` on the module's clock, so device-hours are closed-form."""
    monkeypatch.setattr(UpdateClock, "seconds", lambda self: SECONDS)


def _compute(run_dir: Path) -> dict:
    return json.loads(next(run_dir.rglob("compute.json")).read_text())


def test_report_matches_table3_formulas_for_two_ranks_of_expert_slices():
    # Rank 0 updates experts 0-1 in 10 s over 5 updates, rank 1 experts 2-3 in 6 s.
    tallies = [Tally(updates=5, seconds=10.0, token_forwards=100, experts=2),
               Tally(updates=5, seconds=6.0, token_forwards=80, experts=2)]
    report = compute_report(tallies, elapsed_seconds=36.0, reference_seconds=[0.168, 0.140])
    assert report.expert_mean_update_seconds == pytest.approx([1.0, 1.0, 0.6, 0.6])
    assert report.aggregate_device_hours == pytest.approx(5 * 3.2 / 3600)  # U · Σₑ t̄ₑ / 3600
    assert report.aggregate_device_hours == pytest.approx(16.0 / 3600)  # = all ranks' update seconds
    assert report.physical_device_hours == pytest.approx(2 * 36.0 / 3600)
    assert [r.device_hours for r in report.fixed_rate] == pytest.approx([4 * 5 * 0.168 / 3600, 4 * 5 * 0.140 / 3600])
    assert (report.updates, report.experts, report.ranks, report.token_forwards) == (5, 4, 2, 180)
    # The paper's N = 256 row: 256 · U · 0.168 / 3600 at U = 4.16M updates ≈ 49.7k GPU-hours.
    paper = compute_report([Tally(4_160_000, 1.0, 0, 256)], 0.0, [0.168, 0.140])
    assert [round(r.device_hours / 1000, 1) for r in paper.fixed_rate] == [49.7, 41.4]


@pytest.mark.parametrize(("ranks", "experts_per_rank", "model_experts", "accounting", "step_seconds"), [
    (1, 1, 1, Accounting.device_per_expert, 1.0),  # monolithic SPSA on one device
    (2, 1, 2, Accounting.device_per_expert, 2.0),  # SOMA N = 2, one device per expert (H.1)
    (1, 4, 4, Accounting.batched, 1.0),  # SOMA N = 4 batched on one device: each expert t/4
    (2, 2, 4, Accounting.batched, 2.0),  # two devices of two batched experts each
    (4, 1, 1, Accounting.every_device, 4.0),  # DDPP: one model on 4 devices, each charged the step
    (4, 2, 2, Accounting.every_device, 4.0),  # BPTT N = 2 data-parallel on 4 devices (2 per expert, Table 5)
])
def test_accounting_names_where_the_experts_ran(ranks, experts_per_rank, model_experts, accounting, step_seconds):
    """Every rank steps in 1 s per update for 10 updates: Σₑ t̄ₑ is the devices' summed step time."""
    tallies = [Tally(updates=10, seconds=10.0, token_forwards=0, experts=experts_per_rank) for _ in range(ranks)]
    report = compute_report(tallies, 10.0, [], model_experts=model_experts)
    assert report.accounting is accounting
    assert sum(report.expert_mean_update_seconds) == pytest.approx(step_seconds)
    assert report.aggregate_device_hours == pytest.approx(10 * step_seconds / 3600)


def test_a_step_without_a_new_record_counts_nothing():
    module = SimpleNamespace(last_update=UpdateRecord(0.5, 10, 2))
    fresh = NewRecord()
    assert fresh(module) is module.last_update and fresh(module) is None
    module.last_update = UpdateRecord(0.5, 10, 2)  # equal values, a new update
    assert fresh(module) is module.last_update


def test_resuming_on_fewer_ranks_keeps_every_ranks_totals_on_rank_0():
    accounting = ComputeAccounting()
    accounting.setup(SimpleNamespace(global_rank=0, world_size=1), None, "fit")
    accounting.load_state_dict({"tallies": [{"updates": 4, "seconds": 2.0, "token_forwards": 40, "experts": 1},
                                            {"updates": 4, "seconds": 3.0, "token_forwards": 80, "experts": 2}],
                                "elapsed_seconds": 7.0})
    assert (accounting.tally.updates, accounting.tally.seconds, accounting.tally.token_forwards) == (4, 5.0, 120)
    assert accounting.elapsed_seconds() == 7.0


@pytest.mark.parametrize(("limits", "named"), [({"device_hours": -1.0}, "device_hours"),
                                               ({"token_forwards": 0}, "token_forwards"),
                                               ({"seconds_per_update": 0.0}, "seconds_per_update"),
                                               ({"seconds_per_update": 1.0, "elapsed_hours": 1.0},
                                                "seconds_per_update")])
def test_a_budget_must_be_positive_and_a_calibration_times_device_hours_only(limits, named):
    with pytest.raises(ConfigError, match=f"budget.{named}"):
        ComputeBudget(**limits)


def test_fit_writes_compute_json_and_summary(corpus_dir, tmp_path, fixed_clock):
    run = tmp_path / "run"
    run_cli(fit_args(corpus_dir, tmp_path / "data", run, "--trainer.max_steps=6",
                     "--compute.reference_seconds=[0.168]"))
    compute = _compute(run)
    assert compute["updates"] == 6 and compute["experts"] == 1 and compute["ranks"] == 1
    assert compute["accounting"] == "device_per_expert"
    assert compute["expert_mean_update_seconds"] == pytest.approx([SECONDS])
    assert compute["aggregate_device_hours"] == pytest.approx(6 * SECONDS / 3600)
    assert compute["token_forwards"] == 6 * FORWARDS_PER_UPDATE
    assert compute["fixed_rate"][0]["device_hours"] == pytest.approx(6 * 0.168 / 3600)
    assert compute["physical_device_hours"] == pytest.approx(compute["elapsed_training_seconds"] / 3600)
    assert compute["elapsed_training_seconds"] > 0 and compute["budget"]["reached"] is None
    summary = json.loads(next(run.rglob("summary.json")).read_text())
    assert summary["compute"] == {k: v for k, v in compute.items() if k != "budget"}


@pytest.mark.parametrize("kind", ["device_hours", "elapsed_hours"])  # one expert: its time is the device's
def test_a_time_budget_stops_at_the_update_that_reaches_it(kind, corpus_dir, tmp_path, fixed_clock):
    run = tmp_path / "run"
    run_cli(fit_args(corpus_dir, tmp_path / "data", run, f"--budget.{kind}={4.5 * SECONDS / 3600}"))
    compute = _compute(run)
    assert compute["updates"] == 5 and compute["budget"]["stopped_at_step"] == 5
    assert compute["budget"]["reached"] == kind


def test_a_calibrated_budget_counts_updates_times_the_calibrated_time(corpus_dir, tmp_path, fixed_clock):
    """Calibrated at 1.5 × the (fixed) measured update time, 4.5 measured updates' worth of budget is
    3 calibrated updates: the run stops at update 3, its measured time recorded beside."""
    run = tmp_path / "run"
    run_cli(fit_args(corpus_dir, tmp_path / "data", run, f"--budget.device_hours={4.5 * SECONDS / 3600}",
                     f"--budget.seconds_per_update={1.5 * SECONDS}"))
    budget = _compute(run)["budget"]
    assert budget["stopped_at_step"] == 3 and budget["reached"] == "device_hours"
    assert budget["seconds_per_update"] == pytest.approx(1.5 * SECONDS)
    assert budget["spent"]["device_hours"] == pytest.approx(4.5 * SECONDS / 3600)
    assert budget["measured_device_hours"] == pytest.approx(3 * SECONDS / 3600)


def test_token_budget_stops_a_resumed_run_at_the_same_update(corpus_dir, tmp_path, fixed_clock):
    data, budget = tmp_path / "data", f"--budget.token_forwards={10.5 * FORWARDS_PER_UPDATE}"
    run_cli(fit_args(corpus_dir, data, tmp_path / "straight", budget))
    crashed = fit_args(corpus_dir, data, tmp_path / "crashed", budget,
                       "--trainer.callbacks+=tests.lit.crash.CrashAtStep", "--trainer.callbacks.step=10")
    with pytest.raises(RuntimeError, match="simulated crash at step 10"):
        run_cli(crashed)
    run_cli(fit_args(corpus_dir, data, tmp_path / "crashed", budget, "--ckpt_path=last"))  # from step 8
    straight, resumed = _compute(tmp_path / "straight"), _compute(tmp_path / "crashed")
    for compute in (straight, resumed):
        assert compute["updates"] == 11 and compute["budget"]["stopped_at_step"] == 11
        assert compute["token_forwards"] == 11 * FORWARDS_PER_UPDATE
        assert compute["aggregate_device_hours"] == pytest.approx(11 * SECONDS / 3600)
    assert resumed["elapsed_training_seconds"] > 0


class TwoRanks:
    """A strategy whose all-gather adds a second rank that updates 2 experts in 3 s per update."""

    root_device = torch.device("cpu")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack([tensor, torch.tensor([3.0, 10.0, 1.5], dtype=tensor.dtype)])


def test_elapsed_budget_stops_at_the_slowest_experts_time():
    """Rank 0 updates 1 expert in 1 s, rank 1 two in 3 s (1.5 s each): the slowest expert's time is
    1.5 s per update, so an elapsed budget of 4.5 s stops at update 3, having spent 12 device-seconds."""
    budget = ComputeBudget(elapsed_hours=4.5 / 3600)
    trainer = SimpleNamespace(strategy=TwoRanks(), global_step=0, should_stop=False)
    module = SimpleNamespace()
    for step in range(1, 5):
        module.last_update, trainer.global_step = UpdateRecord(1.0, 10, 1), step
        budget.on_train_batch_end(trainer, module, None, None, step)
        if trainer.should_stop:
            break
    assert budget.stopped_at_step == 3 and budget.reached.value == "elapsed_hours"
    assert budget.expert_seconds == [3.0, 4.5] and budget.seconds == 12.0 and budget.token_forwards == 60
