"""The paper's protocol in every module (Table 1): learning rates decay on each expert's own
held-out 1% training split, never on the ensemble-validation set; BPTT with N > 1 experts is an
ensemble scored exactly as SOMA's."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.tar_shards import sha256_file
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard
from soma_pl.lightning_cli import make_cli
from soma_pl.lit import ZOModule
from soma_pl.lit.args import ModelShape
from soma_pl.lit.bptt import BPTTModule
from soma_pl.lit.plateau import ExpertPlateau, PlateauConfig
from soma_pl.models.router import HashedNgramEncoder, Router

from .conftest import TINY

TINY_SOMA = Path(__file__).with_name("tiny_soma.yaml")
SMALL = ["--model.init_args.shape.width=8", "--model.init_args.shape.num_layers=1",
         "--model.init_args.shape.embed_dim=8",
         "--model.init_args.train_context=24", "--model.init_args.plateau.patience_updates=2"]
# Many validations, so that held-out plateaus (and so decays) happen during the run.
SCHEDULE = ["--trainer.max_steps=16", "--trainer.val_check_interval=2",
            "--model.init_args.plateau.threshold=0.2"]  # improvements this small count as a plateau: decays happen
MODULES = {
    "spsa": (TINY, []),
    "eggroll": (TINY, ["--model=soma_pl.lit.ZOModule", *SMALL,
                       "--model.init_args.eggroll.sigma=0.05",
                       "--model.init_args.eggroll.rank=2", "--model.init_args.eggroll.population=24",
                       "--model.init_args.eggroll.group_size=6",
                       "--model.init_args.seed=3", "--model.init_args.head_training=trainable",
                       "--model.init_args.optimizer=torch.optim.SGD",
                       "--model.init_args.eggroll.step_convention=mean_over_sigma",
                       "--model.init_args.optimizer.lr=0.02"]),
    "ddpp": (TINY, ["--model=soma_pl.lit.ZOModule", *SMALL, "--model.init_args.spsa.eps=0.01",
                    "--model.init_args.spsa.n_pert=4", "--model.init_args.spsa.micro_batch=2",
                    "--model.init_args.spsa.exchange=scalars", "--model.init_args.seed=3",
                    "--model.init_args.optimizer=torch.optim.SGD", "--model.init_args.optimizer.lr=0.1"]),
    "bptt": (TINY, ["--model=soma_pl.lit.BPTTModule", *SMALL, "--model.init_args.optimizer=torch.optim.Adam",
                    "--model.init_args.optimizer.lr=0.5"]),  # large enough to stall: decays happen
    "soma_n2": (TINY_SOMA, []),
    "bptt_n2": (TINY_SOMA, ["--model=soma_pl.lit.BPTTModule", *SMALL, "--model.init_args.num_experts=2",
                            "--model.init_args.top_k=2", "--model.init_args.optimizer=torch.optim.Adam",
                            "--model.init_args.optimizer.lr=0.5"]),
}


@pytest.fixture(scope="module")
def datasets(corpus_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    dataset = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(corpus_dir)]), output_dir=str(root / "data"),
                            val_documents=2, val_windows=4, test_windows=4, shard_max_bytes=40000,
                            expert_val_fraction=0.05)
    prepare(dataset, progress=False)
    shard(ShardConfig(prepared=dataset.output_dir, num_experts=2, output_dir=str(root / "experts"),
                      shard_max_bytes=40000), progress=False)
    return root


def _fit(root: Path, corpus: Path, name: str, run: str) -> tuple[dict, dict]:
    config, extra = MODULES[name]
    experts = [f"--data.init_args.experts_dir={root / 'experts'}"] if config == TINY_SOMA else []
    run_dir = root / run
    cli = make_cli(["fit", "--config", str(config), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
                    f"--data.init_args.dataset.output_dir={root / 'data'}", *experts,
                    f"--trainer.default_root_dir={run_dir}", f"--checkpoint.dirpath={run_dir / 'checkpoints'}",
                    "--trainer.logger=false", *extra, *SCHEDULE])
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return checkpoint, {k: float(v) for k, v in cli.trainer.callback_metrics.items() if v.numel() == 1}


def _decayed(checkpoint: dict) -> bool:
    """Whether any expert's learning-rate multiplier decayed during the run."""
    return bool((checkpoint["state_dict"]["plateau.scale"] < 1).any())


@pytest.mark.parametrize("name", list(MODULES))
def test_changing_only_the_ensemble_validation_set_leaves_training_bitwise_unchanged(datasets, corpus_dir, name):
    root = datasets
    ensemble, manifest = root / "data" / "ensemble_val.npz", root / "data" / "manifest.json"
    original, recorded = EvalSet.load(ensemble), manifest.read_text()
    try:
        first, first_metrics = _fit(root, corpus_dir, name, f"{name}-a")
        other = EvalSet(np.ascontiguousarray(original.windows[:, ::-1]), original.doc_ids, original.sources,
                        original.offsets)  # the same documents' bytes reversed: another set entirely
        other.save(ensemble)
        entries = json.loads(recorded)
        entries["ensemble_val"]["sha256"] = sha256_file(ensemble)  # recorded, as prepare records a set it writes
        manifest.write_text(json.dumps(entries))
        second, second_metrics = _fit(root, corpus_dir, name, f"{name}-b")
    finally:
        original.save(ensemble)
        manifest.write_text(recorded)
    assert first_metrics["val/loss"] != second_metrics["val/loss"], "the ensemble-validation set did change"
    assert _decayed(first) and _decayed(second), "learning rates decayed during both runs"
    assert first["global_step"] == second["global_step"] == 16
    for key, value in first["state_dict"].items():
        assert torch.equal(value, second["state_dict"][key]), key
    assert all(f"expert/{e}/val_loss" in first_metrics for e in range(2 if name.endswith("n2") else 1))


def _router(experts: int) -> Router:
    return Router(HashedNgramEncoder(dim=16), torch.randn(experts, 16, generator=torch.Generator().manual_seed(1)))


def test_bptt_and_soma_with_the_same_weights_and_router_score_alike():
    settings = {"num_experts": 3, "shape": ModelShape(width=8, num_layers=1, embed_dim=8), "top_k": 2}
    soma = ZOModule(init="random", **settings)
    bptt = BPTTModule(**settings)
    bptt.model.load_state_dict(soma.model.state_dict())
    soma.routing.router = bptt.routing.router = _router(3)
    windows = torch.randint(0, 256, (6, 1025), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    a, b = soma.score(windows), bptt.score(windows)
    assert torch.equal(a.loss_by_k, b.loss_by_k) and torch.equal(a.expert_losses, b.expert_losses)
    assert soma.eval_k == bptt.eval_k == 2
    # val/loss is the routed top-2 ensemble, not expert 0 alone
    assert not torch.allclose(b.loss_by_k[:, 1], b.expert_losses[0])


def test_bptt_ensemble_trains_each_expert_on_its_own_data_and_loss():
    module = BPTTModule(num_experts=2, shape=ModelShape(width=8, num_layers=1, embed_dim=8), train_context=24)
    module.configure_optimizers()
    batch = torch.randint(0, 256, (2, 3, 25), generator=torch.Generator().manual_seed(0))
    changed = batch.clone()
    changed[1] = torch.randint(0, 256, (3, 25), generator=torch.Generator().manual_seed(9))
    grads = []
    for tokens in (batch, changed):
        module.zero_grad()
        module.model.loss_per_group({}, tokens).sum().backward()
        grads.append({n: p.grad.clone() for n, p in module.model.expert_parameters().items()})
    for name in grads[0]:
        assert torch.equal(grads[0][name][0], grads[1][name][0]), f"expert 0's {name} saw expert 1's data"
        assert not torch.equal(grads[0][name][1], grads[1][name][1]), name


def test_bptt_ensemble_validates_like_soma_through_the_cli(datasets, corpus_dir):
    root = datasets
    checkpoint, metrics = _fit(root, corpus_dir, "bptt_n2", "bptt-n2-fit")
    assert "router" in checkpoint and {"expert/0/val_loss", "expert/1/val_loss", "expert/0/lr"} <= set(metrics)
    config, extra = MODULES["bptt_n2"]
    cli = make_cli(["validate", "--config", str(config), f"--data.init_args.dataset.corpus.paths=[{corpus_dir}]",
                    f"--data.init_args.dataset.output_dir={root / 'data'}",
                    f"--data.init_args.experts_dir={root / 'experts'}", f"--trainer.default_root_dir={root / 'bv'}",
                    "--trainer.logger=false",
                    *extra, f"--ckpt_path={root / 'bptt-n2-fit' / 'checkpoints' / 'last.ckpt'}"])
    report = json.loads(next((root / "bv").rglob("val_scores.json")).read_text())
    assert report["k"] == 2 and len(report["loss_by_k"]) == 2 and len(report["expert_losses"]) == 2
    assert report["loss"] == pytest.approx(report["loss_by_k"][1], rel=1e-5)
    assert cli.trainer.callback_metrics["val/loss"].item() == pytest.approx(report["loss_by_k"][1], rel=1e-5)


@pytest.mark.parametrize("module_class", [ZOModule, BPTTModule])
def test_min_lr_floors_every_experts_decay(module_class):
    kwargs = {"init": "random"} if module_class is ZOModule else {}
    module = module_class(num_experts=2, shape=ModelShape(width=8, num_layers=1, embed_dim=8),
                          plateau=PlateauConfig(patience_updates=0, min_lr=0.025),
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **kwargs)
    module.configure_optimizers()
    for updates in range(6):  # never improving: a decay at every validation after the first
        module.plateau.step(torch.tensor([3.0, 3.0]), updates)
    assert module.plateau.scale.tolist() == [0.25, 0.25]


def test_expert_plateau_never_goes_below_its_floor():
    plateau = ExpertPlateau(experts=2, config=PlateauConfig(factor=0.5, patience_updates=0, min_lr=0.3))
    plateau.floor_at(1.0)
    for updates in range(5):
        plateau.step(torch.tensor([1.0, 1.0]), updates)
    assert plateau.scale.tolist() == pytest.approx([0.3, 0.3])


def test_eps_below_float32_precision_warns_once():
    module = ZOModule(num_experts=2, shape=ModelShape(width=8, num_layers=1, embed_dim=8), init="random")
    with pytest.warns(UserWarning, match="eps has decayed to 5e-05"):
        module.warn_small_eps(torch.tensor([5e-5, 1e-3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, whatever eps does next
        module.warn_small_eps(torch.tensor([1e-6, 1e-6]))
        module.warn_small_eps(1e-3)
