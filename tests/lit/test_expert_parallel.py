"""Expert-parallel SOMA: ranks own contiguous shares of the experts and read only their shards;
2 gloo processes train the weights, optimizer state and per-expert decay of one process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard
from soma_pl.data.training.stream import WindowStream
from soma_pl.distributed import rank_share
from soma_pl.errors import ConfigError
from soma_pl.lightning_cli import make_cli
from soma_pl.lit import ZOModule
from soma_pl.lit.args import ModelShape
from soma_pl.lit.parallel import slice_optimizer_state

from .multiprocess import fit_on_processes, max_difference

TINY_SOMA = Path(__file__).with_name("tiny_soma.yaml")
EXPERTS = 3


@pytest.mark.parametrize("count,world", [(3, 2), (8, 3), (256, 8), (5, 5)])
def test_rank_shares_are_contiguous_balanced_and_cover_everything(count, world):
    shares = [rank_share(count, rank, world) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(count))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1 and min(map(len, shares)) >= 1


@pytest.fixture(scope="module")
def sharded(corpus_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    dataset = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(corpus_dir)]), output_dir=str(root / "data"),
                            val_documents=2, val_windows=4, test_windows=4, shard_max_bytes=40000,
                            expert_val_fraction=0.1)  # 3 experts: one held-out document each at least
    prepare(dataset, progress=False)
    experts = shard(ShardConfig(prepared=dataset.output_dir, num_experts=EXPERTS, output_dir=str(root / "experts"),
                                shard_max_bytes=40000), progress=False)
    return root, experts


def test_a_rank_reads_for_its_experts_what_one_process_reads(sharded):
    from soma_pl.data.formats.expert_sets import read_expert_shards

    _, experts = sharded
    shard_sets = [[experts / r.path for r in e.train] for e in read_expert_shards(experts)]
    whole = iter(WindowStream(shard_sets, batch_size=3, seed=4, shuffle_buffer=8))
    share = rank_share(EXPERTS, 1, 2)
    part = iter(WindowStream(shard_sets[share.start : share.stop], 3, 4, 8, expert_ids=share))
    for _ in range(3):
        assert torch.equal(next(part), next(whole)[share.start : share.stop])


def test_slicing_a_gathered_optimizer_state_keeps_the_ranks_experts():
    momentum = torch.arange(24.0).view(3, 2, 4)
    state = {"state": {0: {"momentum_buffer": momentum.clone(), "step": torch.tensor(5.0)}}, "param_groups": []}
    slice_optimizer_state(state, [momentum.shape], range(1, 3))
    assert torch.equal(state["state"][0]["momentum_buffer"], momentum[1:3])
    assert state["state"][0]["step"].item() == 5.0


def test_soma_needs_an_expert_per_process(monkeypatch):
    trainer = SimpleNamespace(world_size=3, global_rank=0, ckpt_path=None)
    monkeypatch.setattr(ZOModule, "trainer", property(lambda self: trainer))
    module = ZOModule(num_experts=2, shape=ModelShape(width=8, num_layers=1, embed_dim=8), init="random")
    with pytest.raises(ConfigError, match="2 experts on 3 processes"):
        module.check_world_size(3)


SGD_MOMENTUM = ("--model.init_args.optimizer.init_args.momentum=0.9",)
ADAM = ("--model.init_args.optimizer=soma_pl.lit.optim.ZOAdam", "--model.init_args.optimizer.init_args.lr=0.01")
"""The paper's update: Adam's two moments and step count per expert, gathered and sliced like momentum."""


def _soma_args(corpus: Path, root: Path, experts: Path, run: str, *extra: str,
               optimizer: tuple[str, ...] = SGD_MOMENTUM) -> list[str]:
    return ["--config", str(TINY_SOMA), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
            f"--data.init_args.dataset.output_dir={root / 'data'}", "--data.init_args.dataset.expert_val_fraction=0.1",
            f"--data.init_args.experts_dir={experts}", f"--trainer.default_root_dir={root / run}",
            f"--checkpoint.dirpath={root / run / 'checkpoints'}",
            "--trainer.logger=false", f"--model.init_args.num_experts={EXPERTS}", f"--model.init_args.top_k={EXPERTS}",
            *optimizer, *extra]


def _checkpoint(root: Path, run: str) -> dict:
    return torch.load(root / run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


@pytest.mark.slow
def test_two_processes_train_the_experts_of_one_process(sharded, corpus_dir, tmp_path):
    root, experts = sharded
    make_cli(["fit", *_soma_args(corpus_dir, root, experts, "one")])
    ranks = fit_on_processes(_soma_args(corpus_dir, root, experts, "two"), processes=2, dump=tmp_path)
    one, two = _checkpoint(root, "one"), _checkpoint(root, "two")

    # Rank 0's checkpoint holds every expert, its optimizer state and per-expert decay, as one process's.
    assert max_difference(one["state_dict"], two["state_dict"]) == 0.0
    assert one["state_dict"]["plateau.scale"].min() < 1, "the test should see an expert's learning rate decay"
    for index, entry in one["optimizer_states"][0]["state"].items():
        assert torch.equal(entry["momentum_buffer"], two["optimizer_states"][0]["state"][index]["momentum_buffer"])
    # Each rank trained only its share, to the same weights.
    assert [r["experts"] for r in ranks] == [(0, 1), (1, 3)]
    assert [r["update_experts"] for r in ranks] == [1, 2]
    for rank in ranks:
        low, high = rank["experts"]
        for name, weights in rank["weights"].items():
            assert torch.equal(weights, one["state_dict"][f"model.{name}"][low:high]), name


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "state"), [(SGD_MOMENTUM, ("momentum_buffer",)),
                                                  (ADAM, ("exp_avg", "exp_avg_sq", "step"))])
def test_expert_parallel_run_resumes_to_the_same_weights(sharded, corpus_dir, tmp_path, optimizer, state):
    root, experts = sharded
    name = "adam" if optimizer == ADAM else "sgd"
    make_cli(["fit", *_soma_args(corpus_dir, root, experts, f"straight-{name}", optimizer=optimizer)])
    fit_on_processes(_soma_args(corpus_dir, root, experts, f"resumed-{name}", "--trainer.max_steps=4",
                                optimizer=optimizer), 2, tmp_path / "a")
    fit_on_processes(_soma_args(corpus_dir, root, experts, f"resumed-{name}", "--ckpt_path=last",
                                optimizer=optimizer), 2, tmp_path / "b")
    straight, resumed = _checkpoint(root, f"straight-{name}"), _checkpoint(root, f"resumed-{name}")
    assert resumed["global_step"] == 8
    assert max_difference(straight["state_dict"], resumed["state_dict"]) == 0.0
    resumed_state = resumed["optimizer_states"][0]["state"]
    for index, entry in straight["optimizer_states"][0]["state"].items():
        for key in state:
            np.testing.assert_array_equal(entry[key].numpy(), resumed_state[index][key].numpy())
