"""`predict` writes each window's losses (parquet or JSONL); checkpoint names never nest folders."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from soma_pl.cli import main
from soma_pl.lightning_cli import make_cli
from tests.lit.conftest import corpus_dir, fit_args  # noqa: F401


@pytest.fixture(scope="module")
def fitted(corpus_dir, tmp_path_factory):  # noqa: F811
    """A 4-step tiny SPSA fit whose checkpoint names use the `{val/loss:.4f}` template (at lr 0.05, where
    the 4 updates lower the test loss by 0.019 nats/byte)."""
    root = tmp_path_factory.mktemp("predict")
    main(fit_args(corpus_dir, root / "data", root / "run", "--trainer.max_steps=4",
                  "--model.init_args.optimizer.init_args.lr=0.05",
                  "--checkpoint.filename={val/loss:.4f}", "--checkpoint.monitor=val/loss"))
    return root


def test_checkpoint_filename_with_a_metric_name_stays_in_its_folder(fitted):
    folder = fitted / "run" / "checkpoints"
    assert not [p for p in folder.rglob("*") if p.is_dir()], "no folder inside the checkpoint folder"
    named = sorted(p.name for p in folder.glob("val_loss=*.ckpt"))
    assert len(named) == 1 and named[0].removeprefix("val_loss=").removesuffix(".ckpt").replace(".", "").isdigit()
    loss = torch.load(folder / named[0], weights_only=False)["callbacks"]
    assert any("val/loss" in str(key) for key in loss), "the checkpoint monitors val/loss"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_predict_writes_each_windows_losses(suffix, fitted, corpus_dir):  # noqa: F811
    args = [a for a in fit_args(corpus_dir, fitted / "data", fitted / f"predict{suffix}")[1:]
            if not a.startswith("--checkpoint")]
    cli = make_cli(["predict", *args, f"--ckpt_path={fitted / 'run' / 'checkpoints' / 'last.ckpt'}",
                    f"--predictions.path=windows{suffix}"])
    path = fitted / f"predict{suffix}" / f"windows{suffix}"
    rows = (pq.read_table(path).to_pylist() if suffix == ".parquet"
            else [json.loads(line) for line in path.read_text().splitlines()])
    predictions = cli.trainer.predict_loop.predictions
    losses = torch.cat([p["loss"] for p in predictions], dim=1)  # [E, windows]
    test_set = cli.datamodule.test_set
    assert [r["window"] for r in rows] == list(range(len(test_set))) == list(range(losses.shape[1]))
    for row in rows:
        assert row["expert_losses"] == pytest.approx(losses[:, row["window"]].tolist())
        assert row["mean_expert_loss"] == pytest.approx(losses[:, row["window"]].mean().item())
        assert row["document"] == str(test_set.doc_ids[row["window"]])
        assert row["offset"] == int(test_set.offsets[row["window"]])
    untrained = make_cli(["predict", *args]).trainer.predict_loop.predictions  # the same seed, never trained
    untrained_loss = torch.cat([p["loss"] for p in untrained], dim=1).mean().item()
    assert sum(row["mean_expert_loss"] for row in rows) / len(rows) < untrained_loss - 0.01


def test_prediction_file_of_an_unknown_format_is_one_line(fitted, corpus_dir, capsys):  # noqa: F811
    args = [a for a in fit_args(corpus_dir, fitted / "data", fitted / "bad")[1:] if not a.startswith("--checkpoint")]
    with pytest.raises(SystemExit) as stopped:
        main(["predict", *args, "--predictions.path=windows.csv"])
    assert stopped.value.code != 0
    assert "--predictions.path windows.csv: the suffix must be one of .parquet, .jsonl" in capsys.readouterr().err
