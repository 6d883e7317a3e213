"""Every module, zero-order or BPTT, starts from a seed model of its own width (`init: seed`) or from random weights.

The seed is what the seed recipe trains (a BPTT model, as `configs/bptt.yaml` and `configs/seed.yaml`);
monolithic SPSA, DDPP and EGGROLL copy it as SOMA's experts do, so the sides of a comparison can
start alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.lit import BPTTModule, EGGROLLArgs, ModelShape, ZOModule
from soma_pl.lit.starts import warm_start
from tests.robustness.cli import cli, one_error

from .conftest import final_weights, fit_args, run_cli
from .test_eggroll import EGGROLL

SHAPE = ModelShape(width=8, num_layers=1, embed_dim=8)
MONOLITHIC = {
    "spsa": lambda **kw: ZOModule(shape=SHAPE, **kw),
    "spsa_shared_head": lambda **kw: ZOModule(shape=SHAPE, head_training="frozen_shared", **kw),
    "ddpp": lambda **kw: ZOModule(shape=SHAPE, spsa={"exchange": "scalars"}, **kw),
    "eggroll": lambda **kw: ZOModule(shape=SHAPE, eggroll=EGGROLLArgs(population=24, group_size=6),
                                     head_training="trainable", **kw),
    "bptt": lambda **kw: BPTTModule(shape=SHAPE, **kw),
    "bptt_shared_head": lambda **kw: BPTTModule(shape=SHAPE, head_training="frozen_shared", **kw),
}


def bptt_seed(path: Path, shape: ModelShape = SHAPE) -> dict[str, torch.Tensor]:
    """A BPTT seed model's checkpoint at `path` (weights moved off their initialisation); its weights."""
    torch.manual_seed(11)
    seed = BPTTModule(shape=shape)
    with torch.no_grad():
        for param in seed.parameters():
            param.add_(0.3 * torch.randn_like(param))
    torch.save({"state_dict": seed.state_dict(), "hyper_parameters": dict(seed.hparams)}, path)
    return {name: value.clone() for name, value in seed.model.state_dict().items()}


@pytest.mark.parametrize("name", MONOLITHIC)
def test_a_monolithic_module_starts_as_a_copy_of_a_seed_of_its_width(name, tmp_path):
    path = tmp_path / "seed.ckpt"
    seed = bptt_seed(path)
    module = MONOLITHIC[name](init="seed", seed_checkpoint=str(path))
    assert module.seed_checkpoint == str(path)
    assert not torch.equal(module.model.w_hh, seed["w_hh"])  # its own random initialisation first
    warm_start(module.model, module.seed_checkpoint, module.head_training)
    for weight, value in module.model.state_dict().items():
        expected = seed[weight][0] if module.model.is_shared(weight) else seed[weight]
        assert torch.equal(value, expected), weight
    if name.endswith("shared_head"):  # one head, never trained: frozen at the seed's
        assert "head" not in module.trainable_parameters()


@pytest.mark.parametrize(("init", "given", "start"), [
    (None, None, None), (None, "seed.ckpt", "seed.ckpt"), ("seed", "seed.ckpt", "seed.ckpt"),
    ("random", "seed.ckpt", None), ("random", None, None)])
@pytest.mark.parametrize("name", MONOLITHIC)
def test_init_says_which_start_a_fresh_fit_takes(name, init, given, start, recwarn):
    assert MONOLITHIC[name](init=init, seed_checkpoint=given).seed_checkpoint == start
    unused = [str(w.message) for w in recwarn if "is not used" in str(w.message)]
    # A named checkpoint that `init: random` leaves unused is said, never silently dropped.
    assert unused == ([f"init: random: model.init_args.seed_checkpoint={given} is not used; the fit starts from "
                       "random weights"] if init == "random" and given else [])


@pytest.mark.parametrize(("build", "key"), [
    (lambda: ZOModule(shape=SHAPE, init="seed"), "seed_checkpoint"),
    (lambda: ZOModule(shape=SHAPE, eggroll=EGGROLLArgs(population=24, group_size=6), head_training="trainable",
                      init="seed"),
     "seed_checkpoint"),
    (lambda: ZOModule(shape=SHAPE, spsa={"exchange": "scalars"}, init="seed"), "seed_checkpoint"),
    (lambda: ZOModule(num_experts=2, shape=SHAPE, init="seed"), "seed_checkpoint"),
])
def test_a_seed_start_without_a_checkpoint_is_refused(build, key):
    with pytest.raises(ConfigError, match=rf"^init: seed needs model.init_args.{key} \(or set init: random\)$"):
        build()


def test_the_cli_refuses_a_seed_start_without_a_checkpoint_in_one_line(corpus_dir, tmp_path, capsys):
    args = fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", "--model.init_args.init=seed")
    one_error(cli(capsys, *args), "init: seed needs model.init_args.seed_checkpoint (or set init: random)")


def test_an_eggroll_fit_starts_from_the_seed_or_from_random_weights(corpus_dir, tmp_path):
    """Through `fit`: one update at a vanishing learning rate leaves the seed's weights (or the random ones)."""
    path = tmp_path / "seed.ckpt"
    seed = bptt_seed(path)
    still = [*EGGROLL, "--model.init_args.optimizer.lr=1e-12", "--trainer.max_steps=1",
             f"--model.init_args.seed_checkpoint={path}"]
    data = tmp_path / "data"
    for init, run in (("seed", "warm"), ("random", "cold")):
        run_cli(fit_args(corpus_dir, data, tmp_path / run, *still, f"--model.init_args.init={init}"))
    warm, cold = final_weights(tmp_path / "warm"), final_weights(tmp_path / "cold")
    for name, value in seed.items():
        torch.testing.assert_close(warm[f"model.{name}"], value, rtol=0, atol=1e-6)
        assert (cold[f"model.{name}"] - value).abs().max() > 0.1, name


def test_monolithic_spsa_with_a_shared_head_trains_its_body_and_keeps_the_seeds_head(corpus_dir, tmp_path):
    """Fig. 7's N = 1 (`head_training: frozen_shared` from a seed): the head stays the seed's, as SOMA's does."""
    path = tmp_path / "seed.ckpt"
    seed = bptt_seed(path)
    run_cli(fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", "--model.init_args.head_training=frozen_shared",
                     "--model.init_args.init=seed", f"--model.init_args.seed_checkpoint={path}",
                     "--trainer.max_steps=4"))
    trained = final_weights(tmp_path / "run")
    assert torch.equal(trained["model.head"], seed["head"][0])
    assert not torch.equal(trained["model.w_hh"], seed["w_hh"])


def test_a_bptt_fit_starts_from_its_seed(tmp_path):
    """BPTT copies the seed at setup as the zero-order module does: a fit of no update ends with every
    weight at the seed's (the head too, frozen shared or per expert)."""
    import functools

    import lightning as L

    from tests.pinned.data import PinnedData

    path = tmp_path / "seed.ckpt"
    seed = bptt_seed(path)
    for head_training in ("trainable", "frozen_shared", "decoder_only"):
        module = BPTTModule(shape=SHAPE, init="seed", seed_checkpoint=str(path), head_training=head_training,
                            train_context=40, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        L.Trainer(accelerator="cpu", devices=1, max_steps=0, limit_val_batches=0, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
            module, PinnedData(experts=1, batch_size=2, steps=1))
        for weight, value in module.model.state_dict().items():
            expected = seed[weight][0] if module.model.is_shared(weight) else seed[weight]
            assert torch.equal(value, expected), (head_training, weight)
