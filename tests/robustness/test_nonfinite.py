"""A NaN or infinite loss or weight stops `fit` with one line naming the step and the expert; no
checkpoint with non-finite weights is written, and none is started or resumed from."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from soma_pl.cli import main
from soma_pl.errors import DataError
from soma_pl.lit import BPTTModule, ZOModule
from soma_pl.lit.base import NonFiniteError
from soma_pl.lit.parallel import ExpertShare
from soma_pl.models.checkpoints import monolithic_state
from tests.data.corpora import write_jsonl_corpus
from tests.lit.conftest import fit_args
from tests.robustness.cli import error_line

SMALL = {"shape": {"width": 8, "num_layers": 1, "embed_dim": 8}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A corpus and a finite 4-step run (`run/checkpoints/last.ckpt`)."""
    root = tmp_path_factory.mktemp("nonfinite")
    write_jsonl_corpus(root / "corpus", {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
    main(fit_args(root / "corpus", root / "data", root / "run", "--trainer.max_steps=4"))
    return root



def _poisoned(root: Path, tmp_path: Path) -> Path:
    """The finite run's checkpoint with one NaN weight."""
    checkpoint = torch.load(root / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    checkpoint["state_dict"]["model.w_hh"][0, 0, 0, 0] = float("nan")
    path = tmp_path / "diverged.ckpt"
    torch.save(checkpoint, path)
    return path


def test_a_diverging_run_stops_with_one_line_and_leaves_no_non_finite_checkpoint(root, tmp_path, capsys):
    run = tmp_path / "run"
    line = error_line(fit_args(root / "corpus", root / "data", run, "--model.init_args.optimizer.init_args.lr=1e38",
                               "--divergence.enabled=false"),  # the module's own check, not the bounds
                      capsys)
    assert re.fullmatch(r"soma_pl: error: non-finite (training loss|weights after the update) at step \d+ "
                        r"\(expert 0\): lower the learning rate \(model\.init_args\.optimizer\.init_args\.lr\).*", line)
    assert not (run / "summary.json").exists()
    for path in run.rglob("*.ckpt"):
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        assert all(torch.isfinite(t).all() for name, t in state.items() if name.startswith("model.")), path


def test_the_step_check_names_the_expert_of_a_non_finite_loss_or_weight(monkeypatch):
    module = ZOModule(num_experts=3, **SMALL, init="random", top_k=2)
    finite = torch.tensor([5.0, 5.0, 5.0])
    module.check_finite(4, finite)  # all finite: nothing happens
    with pytest.raises(NonFiniteError, match=r"non-finite training loss at step 4 \(expert 2\)"):
        module.check_finite(4, torch.tensor([5.0, 5.0, float("nan")]))
    with torch.no_grad():
        module.model.w_hh[1, 0, 0, 0] = float("inf")
    monkeypatch.setattr(module.parallel, "share", ExpertShare(range(10, 13), module.model))  # global indices
    with pytest.raises(NonFiniteError, match=r"non-finite weights after the update at step 9 \(expert 11\)"):
        module.check_finite(9, finite)


def test_a_non_finite_validation_loss_stops_the_run(monkeypatch):
    module = BPTTModule(**SMALL, num_experts=2, top_k=2)
    monkeypatch.setattr(module, "_trainer", SimpleNamespace(global_step=8))
    module._check_finite_validation(torch.tensor(5.0), torch.tensor([5.0, 5.0]))
    with pytest.raises(NonFiniteError, match=r"non-finite validation loss \(val/loss\) at step 8"):
        module._check_finite_validation(torch.tensor(float("nan")), None)
    with pytest.raises(NonFiniteError, match=r"non-finite expert-validation loss at step 8 \(expert 1\)"):
        module._check_finite_validation(torch.tensor(5.0), torch.tensor([5.0, float("inf")]))


def test_no_checkpoint_is_written_with_non_finite_weights():
    module = BPTTModule(**SMALL)
    state = {f"model.{name}": value.clone() for name, value in module.model.state_dict().items()}
    checkpoint = {"state_dict": state, "global_step": 3}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["module_class"] == "soma_pl.lit.bptt.BPTTModule"
    state["model.head"][0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="refusing to write a checkpoint at step 3: 'model.head'"):
        module.on_save_checkpoint(checkpoint)


def test_a_non_finite_seed_checkpoint_is_refused(root, tmp_path, capsys):
    path = _poisoned(root, tmp_path)
    with pytest.raises(DataError, match="'model.w_hh' holds NaN or infinite values"):
        monolithic_state(path)
    line = error_line(fit_args(root / "corpus", root / "data", tmp_path / "warm",
                               f"--model.init_args.seed_checkpoint={path}"),
                      capsys)
    assert line == (f"soma_pl: error: seed checkpoint {path}: 'model.w_hh' holds NaN or infinite values "
                    "(a diverged run): start from a finite checkpoint")
    assert not list((tmp_path / "warm").rglob("*.ckpt"))


def test_resuming_a_non_finite_checkpoint_is_refused(root, tmp_path, capsys):
    path = _poisoned(root, tmp_path)
    line = error_line(fit_args(root / "corpus", root / "data", tmp_path / "resumed", f"--ckpt_path={path}",
                          "--trainer.max_steps=8"), capsys)
    assert line.startswith(f"soma_pl: error: {path}: 'model.w_hh' holds NaN or infinite values")
    assert not list((tmp_path / "resumed").rglob("*.ckpt"))
