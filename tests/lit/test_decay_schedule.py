"""The learning-rate / ε schedule (Table 1, §4): each expert's learning rate and ε halve together
after `plateau.patience_updates` updates (the paper: 1,000) without an improvement of at least
`plateau.threshold` (1e-8 nats/byte) in its own expert-validation loss, never below `plateau.min_lr`
(1e-5). Closed-form loss sequences fed to the rule give the halvings at the updates the paper's
words give; the rule's state resumes exactly from a checkpoint.

The decay is also part of the selected schedule (`plateau.every`), not of how often a run
validates: a run that validates at every update for its curves, with `plateau.every=2`, trains bit
for bit as the run that validates every 2 updates did (the demo's main job against its Table 6
selection trial)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.lightning_cli import make_cli
from soma_pl.lit import EpsSchedule, ModelShape, SPSAArgs, ZOModule
from soma_pl.lit.plateau import ExpertPlateau, PlateauConfig
from tests.lit.test_protocol import MODULES, TINY_SOMA, _decayed, datasets  # noqa: F401 (a fixture)

PAPER = PlateauConfig()
"""Table 1's rule: halve after 1,000 updates without an improvement of 1e-8, floor 1e-5."""


def _halvings(plateau: ExpertPlateau, losses: list[tuple[int, list[float]]]) -> list[list[int]]:
    """Feed `(updates, [E] losses)` validations to `plateau`; per expert, the updates at which its
    multiplier halved (read off the multipliers, independently of the rule's own counters)."""
    halved: list[list[int]] = [[] for _ in plateau.multipliers]
    for updates, values in losses:
        before = list(plateau.multipliers)
        plateau.step(torch.tensor(values, dtype=torch.float64), updates)
        for e, (old, new) in enumerate(zip(before, plateau.multipliers, strict=True)):
            if new != old:
                assert new == old * 0.5
                halved[e].append(updates)
    return halved


def test_a_halving_comes_after_1000_updates_without_an_improvement_and_restarts_the_count():
    # Validations every 250 updates; the loss never improves after the first: 1,000 updates
    # without an improvement are reached at 1,250, then again (the count restarted) at 2,250.
    losses = [(u, [2.0]) for u in range(250, 3001, 250)]
    assert _halvings(ExpertPlateau(1, PAPER), losses) == [[1250, 2250]]


def test_an_improvement_below_1e_8_does_not_count():
    small = [(250, [2.0])] + [(u, [2.0 - 5e-9]) for u in range(500, 1501, 250)]
    assert _halvings(ExpertPlateau(1, PAPER), small) == [[1250]]
    # 2e-8 at 1,000 is an improvement: the next halving is 1,000 updates later.
    enough = [(250, [2.0]), (500, [2.0]), (750, [2.0]), (1000, [2.0 - 2e-8])] + \
        [(u, [2.0 - 2e-8]) for u in range(1250, 2251, 250)]
    assert _halvings(ExpertPlateau(1, PAPER), enough) == [[2000]]


@pytest.mark.parametrize("every", [100, 250, 500])
def test_the_halving_depends_on_updates_not_on_how_many_validations_fell_between(every):
    # The loss falls by 0.01 per 100 updates until update 1,000, then stays: whatever the cadence,
    # the last improvement is seen at 1,000 and the halving at 2,000.
    losses = [(u, [3.0 - 0.01 * min(u, 1000) / 100]) for u in range(every, 3001, every)]
    assert _halvings(ExpertPlateau(1, PAPER), losses) == [[2000, 3000]]


def test_two_experts_decay_independently():
    # Expert 0 improves by 0.01 at every validation; expert 1 stalls after its first.
    losses = [(u, [3.0 - 0.01 * u / 250, 2.0]) for u in range(250, 2501, 250)]
    assert _halvings(ExpertPlateau(2, PAPER), losses) == [[], [1250, 2250]]


def _spsa_module(monkeypatch, **plateau) -> ZOModule:
    torch.manual_seed(0)
    module = ZOModule(shape=ModelShape(width=8, num_layers=1, embed_dim=8), train_context=24,
                      spsa=SPSAArgs(eps=2e-3, n_pert=4, micro_batch=2, eps_schedule=EpsSchedule.proportional),
                      plateau=PlateauConfig(**plateau),
                      optimizer=lambda params: torch.optim.SGD(params, lr=1e-3))
    optimizer = module.configure_optimizers()
    monkeypatch.setattr(module, "optimizers", lambda: optimizer)  # what the Trainer would hand it
    return module


def test_lr_and_eps_halve_together_and_stop_at_the_floor_of_1e_5(monkeypatch):
    module = _spsa_module(monkeypatch)
    lrs, eps = [], []
    for updates in range(1000, 12001, 1000):  # never improving after the first: a halving every 1,000
        module.plateau.step(torch.tensor([2.0]), updates)
        lrs.append(float(module.current_lr()))
        eps.append(module.current_scale())
    expected = [max(1e-3 * 0.5 ** k, 1e-5) for k in range(12)]  # 1e-3 → 1e-5 in 6.6 halvings
    assert lrs == pytest.approx(expected, rel=1e-6)
    assert [e / 2e-3 for e in eps] == pytest.approx([lr / 1e-3 for lr in expected], rel=1e-6)
    assert lrs[6] > 1e-5 and lrs[7] == lrs[-1] == pytest.approx(1e-5)  # floored from the 7th halving on


def test_a_learning_rate_below_the_floor_is_never_raised():
    plateau = ExpertPlateau(1, PAPER)
    plateau.floor_at(1e-6)  # an optimizer learning rate already below min_lr = 1e-5
    _halvings(plateau, [(u, [2.0]) for u in range(1000, 4001, 1000)])
    assert plateau.multipliers == [1.0]


def test_one_model_and_each_expert_scale_eps_with_their_own_multiplier(monkeypatch):
    """N = 1 follows the same per-expert rule (one expert): its ε is a number, SOMA's one per expert."""
    module = _spsa_module(monkeypatch, patience_updates=0)
    module.plateau.step(torch.tensor([2.0]), 10)
    module.plateau.step(torch.tensor([2.0]), 20)
    assert module.current_scale() == 1e-3 and float(module.current_lr()) == pytest.approx(5e-4, rel=1e-6)
    soma = ZOModule(num_experts=2, init="random", shape=ModelShape(width=8, num_layers=1, embed_dim=8),
                    spsa=SPSAArgs(eps=2e-3), plateau=PlateauConfig(patience_updates=0))
    soma.plateau.step(torch.tensor([2.0, 2.0]), 10)
    soma.plateau.step(torch.tensor([1.0, 2.0]), 20)
    assert soma.current_scale().tolist() == pytest.approx([2e-3, 1e-3])


def test_the_rules_state_resumes_exactly_from_a_checkpoint(tmp_path):
    losses = [(u, [3.0 - 0.01 * min(u, 1000) / 100, 2.0]) for u in range(250, 3751, 250)]
    straight = ExpertPlateau(2, PAPER)
    _halvings(straight, losses)
    interrupted = ExpertPlateau(2, PAPER)
    _halvings(interrupted, losses[:7])  # stopped at 1,750, between two halvings of expert 1
    torch.save(interrupted.state_dict(), tmp_path / "plateau.pt")
    resumed = ExpertPlateau(2, PAPER)
    resumed.load_state_dict(torch.load(tmp_path / "plateau.pt", weights_only=True))
    assert resumed.multipliers == interrupted.multipliers == [1.0, 0.5]  # the host copy is the loaded one
    _halvings(resumed, losses[7:])
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert resumed.multipliers == straight.multipliers == [0.25, 0.125]


def test_a_one_model_checkpoint_holds_the_rules_state(monkeypatch):
    module = _spsa_module(monkeypatch, patience_updates=0)
    module.plateau.step(torch.tensor([2.0]), 10)
    module.plateau.step(torch.tensor([2.0]), 20)
    fresh = _spsa_module(monkeypatch)
    fresh.load_state_dict(module.state_dict())
    assert {"plateau.best", "plateau.since", "plateau.scale"} <= module.state_dict().keys()
    assert (float(fresh.current_lr()), fresh.current_scale()) == (pytest.approx(5e-4, rel=1e-6), 1e-3)


@pytest.mark.parametrize(("setting", "value"), [("patience_updates", -1), ("threshold", -1e-8),
                                                 ("min_lr", float("nan")), ("every", 0)])
def test_a_bad_setting_is_refused_naming_it(setting, value):
    with pytest.raises(ConfigError, match=f"plateau.{setting}="):
        PlateauConfig(**{setting: value})


def test_every_is_checked_where_it_is_defined():
    assert PlateauConfig(every=200).checks_at(400) and not PlateauConfig(every=200).checks_at(250)
    assert PlateauConfig().checks_at(7)


# --- end to end through the CLI -------------------------------------------------------------
def _fit(root: Path, corpus: Path, name: str, run: str, schedule: list[str]) -> tuple[dict, list[int]]:
    config, extra = MODULES[name]
    experts = [f"--data.init_args.experts_dir={root / 'experts'}"] if config == TINY_SOMA else []
    run_dir = root / run
    make_cli(["fit", "--config", str(config), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
              f"--data.init_args.dataset.output_dir={root / 'data'}", *experts,
              f"--trainer.default_root_dir={run_dir}", f"--checkpoint.dirpath={run_dir / 'checkpoints'}",
              "--checkpoint.save_top_k=-1", "--trainer.logger=false", *extra,
              "--model.init_args.plateau.patience_updates=2", "--model.init_args.plateau.threshold=0.05",
              "--trainer.max_steps=16", *schedule])  # improvements this small count as a plateau: decays happen
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    steps = sorted(int(p.stem.split("step=")[1]) for p in (run_dir / "checkpoints").glob("*step=*.ckpt"))
    return checkpoint, steps


@pytest.mark.parametrize("name", ["spsa", "soma_n2", "bptt"])
def test_validating_more_often_leaves_the_decay_and_the_weights_unchanged(datasets, corpus_dir, name):  # noqa: F811
    selected, selected_steps = _fit(datasets, corpus_dir, name, f"{name}-every2",
                                    ["--trainer.val_check_interval=2"])
    curves, curve_steps = _fit(datasets, corpus_dir, name, f"{name}-every1",
                               ["--trainer.val_check_interval=1", "--model.init_args.plateau.every=2"])
    assert curve_steps == list(range(1, 17)) and selected_steps == list(range(2, 17, 2))
    assert _decayed(selected), "the tiny run's learning rate decayed: the schedule was exercised"
    for key, value in selected["state_dict"].items():
        assert torch.equal(value, curves["state_dict"][key]), key


@pytest.mark.parametrize(("cadence", "every", "halvings"), [(200, None, [1400]), (100, None, [1300]),
                                                          (100, 200, [1400])])
def test_an_extra_validation_can_move_a_halving_unless_every_skips_it(cadence, every, halvings):
    """The control: the rule reads every validation's loss by default, so a run validating more often
    can see an improvement (here a dip at update 300) that its selection trial never saw, and decay
    later or sooner; `plateau.every` makes it read only the selection's validations."""
    config = PlateauConfig(every=every)
    losses = [(u, [2.0 if u < 300 else 1.9 if u == 300 else 1.95]) for u in range(cadence, 1501, cadence)]
    read = [(u, values) for u, values in losses if config.checks_at(u)]  # as `on_validation_epoch_end` does
    assert _halvings(ExpertPlateau(1, config), read) == [halvings]
