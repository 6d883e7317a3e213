"""The fit's progress bar shows its total after a resume (`60/100`, not `60/?`)."""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar

from soma_pl.lightning_cli import make_cli
from soma_pl.trainer import ResumingProgressBar, Trainer
from tests.lit.conftest import fit_args


def test_a_resumed_fit_shows_its_total(dataset, tmp_path):
    corpus, data = dataset
    run, bar = tmp_path / "run", "--trainer.enable_progress_bar=true"
    make_cli(fit_args(corpus, data, run, "--trainer.max_steps=4", bar))
    cli = make_cli(fit_args(corpus, data, run, "--trainer.max_steps=8", bar, "--ckpt_path=last"))
    shown = cli.trainer.progress_bar_callback.train_progress_bar
    assert (shown.n, shown.total) == (8, 8) and "8/8" in str(shown)


def test_the_default_bar_resumes_and_a_configured_one_is_kept():
    assert isinstance(Trainer(logger=False).progress_bar_callback, ResumingProgressBar)
    assert Trainer(logger=False, enable_progress_bar=False).progress_bar_callback is None
    mine = TQDMProgressBar(refresh_rate=5)
    assert Trainer(logger=False, callbacks=mine).progress_bar_callback is mine
