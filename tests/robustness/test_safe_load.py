"""Checkpoints load with `weights_only=True`: a planted `__reduce__` runs through no entry point, and
`evaluate` imports nothing a checkpoint names; every module's own checkpoint still loads."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from soma_pl.callbacks.checkpoint_io import AtomicCheckpointIO
from soma_pl.cli import main
from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.errors import DataError
from soma_pl.lit import BPTTModule, ZOModule
from soma_pl.models.checkpoints import load_checkpoint
from soma_pl.models.router import HashedNgramEncoder, Router
from tests.data.corpora import write_jsonl_corpus
from tests.lit.conftest import fit_args

TINY = {"shape": {"width": 8, "num_layers": 1, "embed_dim": 8}}


class Planted:
    """Unpickling this creates `marker`: what a crafted checkpoint's code would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PrepareConfig:
    folder = tmp_path_factory.mktemp("safe_load")
    write_jsonl_corpus(folder / "corpus", {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
    config = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder / "corpus")]),
                           output_dir=str(folder / "data"), val_documents=2, val_windows=4, test_windows=4,
                           shard_max_bytes=40000, expert_val_fraction=0.05)  # tiny_spsa.yaml's: `fit` reuses it
    prepare(config, progress=False)
    return config


def _save(module, path: Path, **extra) -> Path:
    """A checkpoint laid out as Lightning writes one (with `_class_path`, as LightningCLI adds)."""
    hparams = {**dict(module.hparams), "_class_path": f"soma_pl.lit.{type(module).__name__}"}
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": hparams, **extra}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    """A monolithic SPSA checkpoint that would create `marker` when unpickled."""
    marker = tmp_path / "code_ran"
    return _save(ZOModule(**TINY), tmp_path / "planted.ckpt", planted=Planted(marker)), marker


def _exit_code(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


def _one_line_error(capsys, code: int) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("soma_pl: error:"), err
    return err[0]


def _entry_point(name: str, checkpoint: Path, prepared: PrepareConfig, tmp_path: Path) -> list[str]:
    data = Path(prepared.output_dir)
    corpus = Path(prepared.corpus.paths[0])
    if name == "evaluate":
        text = tmp_path / "text.txt"
        text.write_text("river stone " * 400)
        return ["evaluate", "--checkpoint", str(checkpoint), "--text", str(text), "--out", str(tmp_path / "e.json")]
    if name == "analyze topk":
        return ["analyze", "topk", "--checkpoint", str(checkpoint), "--data", str(data),
                "--out", str(tmp_path / "t.json")]
    if name == "analyze variance":
        return ["analyze", "variance", "--panels", "[n_pert]", "--checkpoint", str(checkpoint), "--data", str(data),
                "--context", "4", "--batch", "1", "--experts", "1", "--loss_groupings", "[1]", "--n_pert", "[2]",
                "--repeats", "2",
                "--out", str(tmp_path / "v.json")]
    run = tmp_path / "run"
    if name == "fit seed_checkpoint":
        return fit_args(corpus, data, run, "--trainer.max_steps=1", f"--model.init_args.seed_checkpoint={checkpoint}")
    if name == "fit seed_checkpoint":
        return fit_args(corpus, data, run, "--model=soma_pl.lit.ZOModule", "--model.init_args.num_experts=1",
                        "--model.init_args.init=seed", f"--model.init_args.seed_checkpoint={checkpoint}",
                        *(f"--model.init_args.{k}={v}" for k, v in TINY.items()), "--trainer.max_steps=1")
    return fit_args(corpus, data, run, "--trainer.max_steps=1", f"--ckpt_path={checkpoint}")


@pytest.mark.parametrize("entry", ["evaluate", "analyze topk", "analyze variance", "fit seed_checkpoint",
                                   "fit seed_checkpoint", "fit --ckpt_path"])
def test_a_planted_reduce_runs_through_no_entry_point(entry, prepared, tmp_path, capsys):
    checkpoint, marker = _planted(tmp_path)
    code = _exit_code(_entry_point(entry, checkpoint, prepared, tmp_path))
    assert not marker.exists(), "the checkpoint's code ran"
    line = _one_line_error(capsys, code)
    assert str(checkpoint) in line and "io.open" in line


def test_evaluate_imports_no_class_a_checkpoint_names(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "imported"
    (tmp_path / "planted_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    checkpoint = _save(ZOModule(**TINY), tmp_path / "named.ckpt")
    payload = torch.load(checkpoint, weights_only=False)
    payload["hyper_parameters"]["_class_path"] = "planted_module.Evil"
    torch.save(payload, checkpoint)
    text = tmp_path / "text.txt"
    text.write_text("river stone " * 400)
    code = _exit_code(["evaluate", "--checkpoint", str(checkpoint), "--text", str(text),
                       "--out", str(tmp_path / "e.json")])
    assert not marker.exists(), "evaluate imported the module the checkpoint names"
    line = _one_line_error(capsys, code)
    assert "'planted_module.Evil' is not one of soma_pl's modules" in line and str(checkpoint) in line


def test_evaluate_does_not_import_the_optimizer_a_checkpoint_names(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "planted_optim.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = ZOModule(**TINY)
    module.hparams["optimizer"] = {"class_path": "planted_optim.Evil", "init_args": {"lr": 0.1}}
    checkpoint = _save(module, tmp_path / "optim.ckpt")
    text = tmp_path / "text.txt"
    text.write_text("river stone " * 400)
    code = _exit_code(["evaluate", "--checkpoint", str(checkpoint), "--text", str(text),
                       "--out", str(tmp_path / "e.json"), "--resamples", "10"])
    assert not marker.exists(), "evaluate imported the optimizer class the checkpoint names"
    assert code == 0 and json.loads((tmp_path / "e.json").read_text())["module"] == "ZOModule"


def _soma() -> ZOModule:
    module = ZOModule(num_experts=2, init="random", top_k=2, **TINY)
    module.routing.router = Router(HashedNgramEncoder(dim=16), torch.randn(2, 16))
    return module


@pytest.mark.parametrize("build", [lambda: ZOModule(**TINY), lambda: BPTTModule(**TINY), _soma,
                                   lambda: ZOModule(eggroll={"population": 24, "group_size": 6},
                                                    head_training="trainable", **TINY),
                                   lambda: ZOModule(spsa={"exchange": "estimates"}, **TINY)],
                         ids=["SPSA", "BPTT", "SOMA", "EGGROLL", "DDPP"])
def test_every_module_checkpoint_loads_weights_only_enums_and_router_included(build, tmp_path):
    module = build()  # built in Python: its hyperparameters hold soma_pl enums
    path = _save(module, tmp_path / "own.ckpt")
    loaded = load_checkpoint(path)
    assert loaded["hyper_parameters"] == {**dict(module.hparams), "_class_path": f"soma_pl.lit.{type(module).__name__}"}
    for name, value in module.state_dict().items():
        assert torch.equal(loaded["state_dict"][name], value), name
    if module.routing.routed:
        router = Router.load_from(io.BytesIO(loaded["router"]), "in the checkpoint")
        assert torch.equal(router.centroids, module.routing.router.centroids)
    assert AtomicCheckpointIO().load_checkpoint(path)["state_dict"].keys() == loaded["state_dict"].keys()


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", "truncated"])
def test_a_damaged_file_is_one_data_error_naming_it(content, tmp_path):
    path = tmp_path / "bad.ckpt"
    if content == "truncated":
        whole = _save(ZOModule(**TINY), tmp_path / "whole.ckpt").read_bytes()
        content = whole[: len(whole) // 2]
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"unreadable checkpoint .*bad\.ckpt \(truncated, corrupt") as error:
        load_checkpoint(path)
    assert "\n" not in str(error.value)


def test_a_torch_file_without_state_dict_is_not_a_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "router.pt")
    with pytest.raises(DataError, match=r"router\.pt is not a Lightning checkpoint: it holds no state_dict"):
        load_checkpoint(tmp_path / "router.pt")
