"""Every numeric setting is checked where it is given: a bad one ends `fit` with one line naming the
key (exit 2), before any data is prepared or any step runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import ConfigError
from soma_pl.estimators.spsa import SPSAConfig
from soma_pl.lit import BPTTModule, ZOModule
from tests.data.corpora import write_jsonl_corpus
from tests.lit.conftest import fit_args
from tests.robustness.cli import error_line

SOMA = Path(__file__).parents[1] / "lit" / "tiny_soma.yaml"
BPTT = ["--model=soma_pl.lit.BPTTModule", "--model.init_args.shape.width=8", "--model.init_args.shape.num_layers=1",
        "--model.init_args.shape.embed_dim=8", "--model.init_args.train_context=24"]
LR = "--model.init_args.optimizer.init_args.lr"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("numbers_corpus")
    write_jsonl_corpus(folder, {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
    return folder



@pytest.mark.parametrize(("extra", "message"), [
    ([f"{LR}=0"], "model.init_args.optimizer.init_args.lr=0 must be a positive finite number"),
    ([f"{LR}=-0.1"], "model.init_args.optimizer.init_args.lr=-0.1 must be a positive finite number"),
    ([f"{LR}=1e400"], "model.init_args.optimizer.init_args.lr=inf must be a positive finite number"),
    (["--model.init_args.spsa.eps=0"], "model.init_args.spsa.eps=0.0 must be a positive finite number"),
    (["--model.init_args.spsa.n_pert=0"], "model.init_args.spsa.n_pert=0 must be >= 1"),
    (["--model.init_args.spsa.micro_batch=0"], "model.init_args.spsa.micro_batch=0 must be >= 1"),
    (["--model.init_args.spsa.max_rows=0"], "model.init_args.spsa.max_rows=0 must be >= 1 (or null)"),
    (["--model.init_args.shape.width=0"], "model.init_args.shape.width=0 must be >= 1"),
    (["--model.init_args.shape.num_layers=0"], "model.init_args.shape.num_layers=0 must be >= 1"),
    (["--model.init_args.shape.embed_dim=-1"], "model.init_args.shape.embed_dim=-1 must be >= 1"),
    (["--model.init_args.shape.time_chunk=0"], "model.init_args.shape.time_chunk=0 must be >= 1"),
    (["--model.init_args.train_context=0"], "model.init_args.train_context=0 must be in [1, 1024]"),
    (["--model.init_args.score_from=1024"], "model.init_args.score_from=1024 must be in [0, 1023]"),
    (["--model.init_args.plateau.factor=1.5"], "model.init_args.plateau.factor=1.5 must be in (0, 1)"),
    (["--model.init_args.plateau.patience_updates=-1"], "model.init_args.plateau.patience_updates=-1 must be >= 0"),
    (["--model.init_args.plateau.min_lr=-1"], "model.init_args.plateau.min_lr=-1.0 must be a finite number >= 0"),
    ([*BPTT, "--model.init_args.plateau.factor=0"], "model.init_args.plateau.factor=0.0 must be in (0, 1)"),
    ([*BPTT, "--model.init_args.optimizer=torch.optim.Adam", f"{LR}=0"],
     "model.init_args.optimizer.init_args.lr=0 must be a positive finite number"),
    (["--data.init_args.batch_size=0"], "data.init_args.batch_size=0 must be >= 1"),
    (["--data.init_args.eval_batch_size=0"], "data.init_args.eval_batch_size=0 must be >= 1"),
    (["--data.init_args.shuffle_buffer=0"], "data.init_args.shuffle_buffer=0 must be >= 1"),
    (["--data.init_args.num_workers=-1"], "data.init_args.num_workers=-1 must be >= 0"),
    (["--data.init_args.dataset.val_documents=0"], "dataset.val_documents=0 must be >= 1"),
    (["--data.init_args.dataset.val_documents=-3"], "dataset.val_documents=-3 must be >= 1"),
    (["--data.init_args.dataset.val_windows=0"], "dataset.val_windows=0 must be >= 1"),
    (["--data.init_args.dataset.test_windows=0"], "dataset.test_windows=0 must be >= 1"),
    (["--data.init_args.dataset.test_oversample=0.5"], "dataset.test_oversample=0.5 must be a finite number >= 1"),
    (["--data.init_args.dataset.shingle_bytes=0"], "dataset.shingle_bytes=0 must be in [1, 1025]"),
    (["--data.init_args.dataset.shingle_bytes=1026"], "dataset.shingle_bytes=1026 must be in [1, 1025]"),
    (["--data.init_args.dataset.shard_max_bytes=0"], "dataset.shard_max_bytes=0 must be >= 1"),
])
def test_a_bad_number_is_one_line_naming_its_key(corpus, tmp_path, capsys, extra, message):
    line = error_line(fit_args(corpus, tmp_path / "data", tmp_path / "run", *extra), capsys)
    assert line.startswith(f"soma_pl: error: {message}")
    assert not (tmp_path / "data").exists(), "the check comes before any data is prepared"


@pytest.mark.parametrize(("extra", "message"), [
    (["--model.init_args.top_k=0"], "top_k=0 must be >= 1"),
    (["--model.init_args.num_experts=0"], "model.init_args.num_experts=0 must be >= 1"),
    ([f"{LR}=0"], "model.init_args.optimizer.init_args.lr=0 must be a positive finite number"),
])
def test_soma_numbers(corpus, tmp_path, capsys, extra, message):
    argv = [*fit_args(corpus, tmp_path / "data", tmp_path / "run"), "--config", str(SOMA), *extra]
    assert error_line(argv, capsys) == f"soma_pl: error: {message}"


def test_batch_size_must_split_into_micro_batches_before_the_first_step(corpus, tmp_path, capsys):
    line = error_line(fit_args(corpus, tmp_path / "data", tmp_path / "run", "--data.init_args.batch_size=5"), capsys)
    assert line == "soma_pl: error: data.init_args.batch_size=5 is not a multiple of model.init_args.spsa.micro_batch=2"
    assert not list((tmp_path / "run").rglob("*.ckpt"))


def test_constructors_refuse_bad_numbers():
    small = {"shape": {"width": 8, "num_layers": 1, "embed_dim": 8}}
    with pytest.raises(ConfigError, match="model.init_args.spsa.eps=-1"):
        ZOModule(**small, spsa={"eps": -1.0})
    with pytest.raises(ConfigError, match="model.init_args.score_from=-1"):
        ZOModule(**small, score_from=-1)
    with pytest.raises(ConfigError, match="model.init_args.plateau.min_lr=nan"):
        BPTTModule(**small, plateau={"min_lr": float("nan")})
    with pytest.raises(ConfigError, match="top_k=0"):
        ZOModule(num_experts=2, **small, init="random", top_k=0)
    with pytest.raises(ConfigError, match="lr=0"):
        ZOModule(**small, optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.0}})


def test_estimator_config_names_the_bad_field():
    for field, value in [("eps", 0.0), ("eps", float("inf")), ("n_pert", 0), ("micro_batch", 0),
                         ("loss_grouping", 0), ("max_rows", 0)]:
        with pytest.raises(ValueError, match=f"{field}="):
            SPSAConfig(**{field: value})


def test_prepare_config_is_checked_by_prepare_and_the_data_module(tmp_path):
    config = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(tmp_path / "absent")]),
                           output_dir=str(tmp_path / "out"), val_documents=0)
    with pytest.raises(ConfigError, match="dataset.val_documents=0"):
        prepare(config, progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="dataset.val_documents=0"):
        ByteDataModule(config)
    PrepareConfig(seed=-7, shingle_bytes=1025, test_oversample=1.0).validate()  # the limits themselves pass
