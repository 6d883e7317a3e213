"""`last.ckpt` is the state a `fit` ended in, and resuming from it continues bitwise as an
uninterrupted run; a checkpoint of another module class, or a `--ckpt_path` that is no checkpoint,
is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from soma_pl.cli import main
from tests.data.corpora import write_jsonl_corpus
from tests.lit.conftest import fit_args
from tests.robustness.cli import error_line

SMALL = ["--model.init_args.shape.width=8", "--model.init_args.shape.num_layers=1",
         "--model.init_args.shape.embed_dim=8",
         "--model.init_args.train_context=24"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A corpus, its prepared dataset, and a run of 7 steps validated every 4 (`seven`)."""
    root = tmp_path_factory.mktemp("final")
    write_jsonl_corpus(root / "corpus", {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
    main(fit_args(root / "corpus", root / "data", root / "seven", "--trainer.max_steps=7"))
    return root


def _fit(runs: Path, run: str, *extra: str) -> None:
    main(fit_args(runs / "corpus", runs / "data", runs / run, *extra))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)



def test_last_checkpoint_holds_the_end_state_and_the_summary_points_at_it(runs):
    last = runs / "seven" / "checkpoints" / "last.ckpt"
    assert _load(last)["global_step"] == 7
    summary = json.loads((runs / "seven" / "summary.json").read_text())
    assert summary["global_step"] == 7
    assert Path(summary["last_checkpoint"]) == last


def test_resuming_the_end_state_continues_bitwise(runs, tmp_path):
    stall = "--model.init_args.plateau.threshold=1.0"  # no improvement counts: a decay at the validation at 8
    _fit(runs, str(tmp_path / "eleven"), "--trainer.max_steps=11", stall)
    resumed = tmp_path / "resumed"
    _fit(runs, str(resumed), "--trainer.max_steps=7", stall)
    assert _load(resumed / "checkpoints" / "last.ckpt")["global_step"] == 7  # resumed from the end state
    _fit(runs, str(resumed), "--trainer.max_steps=11", "--ckpt_path=last", stall)
    straight, continued = (_load(tmp_path / "eleven" / "checkpoints" / "last.ckpt"),
                           _load(resumed / "checkpoints" / "last.ckpt"))
    assert straight["global_step"] == continued["global_step"] == 11
    assert straight["state_dict"].keys() == continued["state_dict"].keys()
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(tensor, continued["state_dict"][name]), name
    momentum = [s["momentum_buffer"] for s in straight["optimizer_states"][0]["state"].values()]
    assert all(torch.equal(a, s["momentum_buffer"])
               for a, s in zip(momentum, continued["optimizer_states"][0]["state"].values(), strict=True))
    assert straight["state_dict"]["plateau.scale"].item() == 0.5  # the decay at step 8 happened in both


def test_resume_with_another_module_class_is_one_line(runs, tmp_path, capsys):
    ckpt = runs / "seven" / "checkpoints" / "last.ckpt"
    argv = fit_args(runs / "corpus", runs / "data", tmp_path / "bptt", "--model=soma_pl.lit.BPTTModule", *SMALL,
                    f"--ckpt_path={ckpt}", "--trainer.max_steps=8")
    line = error_line(argv, capsys)
    assert line.startswith(f"soma_pl: error: {ckpt} was written by soma_pl.lit.zo.ZOModule, the configured "
                           f"model is soma_pl.lit.bptt.BPTTModule")


def test_ddpp_resumes_an_spsa_checkpoint(runs, tmp_path):
    """The same training state (DDPP is SPSA with its directions shared across ranks): allowed."""
    ckpt = runs / "seven" / "checkpoints" / "last.ckpt"
    _fit(runs, str(tmp_path / "ddpp"), "--model.init_args.spsa.exchange=scalars", *SMALL,
         "--model.init_args.spsa.n_pert=4",
         "--model.init_args.spsa.micro_batch=2", f"--ckpt_path={ckpt}", "--trainer.max_steps=8")
    assert _load(tmp_path / "ddpp" / "checkpoints" / "last.ckpt")["global_step"] == 8


@pytest.mark.parametrize("kind", ["missing", "text"])
def test_a_ckpt_path_that_is_no_checkpoint_is_one_line_before_any_data_is_prepared(runs, tmp_path, capsys, kind):
    path = tmp_path / "model.ckpt"
    if kind == "text":
        path.write_text("not a checkpoint\n")
    line = error_line(fit_args(runs / "corpus", tmp_path / "data", tmp_path / "run", f"--ckpt_path={path}"), capsys)
    expected = "no such checkpoint file" if kind == "missing" else "is not a checkpoint"
    assert line.startswith(f"soma_pl: error: --ckpt_path {path}") and expected in line
    assert not (tmp_path / "data").exists()
