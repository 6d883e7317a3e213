"""`GRUModule` (EGGROLL's GRU recipe, App. I.1) through the real CLI: a tiny fit and what it records,
streams carried across updates, exact resume mid-window, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.export import export
from soma_pl.generate import SamplingArgs, generate_bytes
from soma_pl.lightning_cli import make_cli
from soma_pl.lit import GRUModule
from soma_pl.lit.loading import load_module

from .conftest import TINY_GRU, final_weights, fit_args, run_cli
from .multiprocess import fit_on_processes, max_difference


def _fit_args(corpus, tmp_path, name: str, *extra: str) -> list[str]:
    return fit_args(corpus, tmp_path / "data", tmp_path / name, *extra, config=TINY_GRU)


def test_fit_moves_the_weights_by_the_step_and_records_the_population(corpus_dir, tmp_path):
    args = _fit_args(corpus_dir, tmp_path, "run")
    initial = {name: value.clone() for name, value in make_cli(args[1:], run=False).model.state_dict().items()}
    cli = make_cli(args)
    module = cli.model
    assert module.method == "eggroll" and isinstance(module, GRUModule)
    record = module.last_update
    assert record.token_forwards == 16 * 300 and record.experts == 1 and record.seconds > 0
    metrics = cli.trainer.callback_metrics
    assert 0 < metrics["train/moved"].item() < 1 and metrics["train/sigma"].item() == 1 / 16
    assert torch.isfinite(metrics["val/loss"])
    trained = final_weights(tmp_path / "run")
    for name in module.model.state_dict():  # every weight moves by whole steps of lr = 0.05
        change = (trained[f"model.{name}"] - initial[f"model.{name}"]) / 0.05
        assert change.abs().max() > 0.5, name
        torch.testing.assert_close(change, change.round(), atol=1e-3, rtol=0)
    # 8 updates of 300 bytes from 1,025-byte windows: new windows at steps 0, 3 and 6, read up to byte 600
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    streams = checkpoint["streams"]
    assert streams["cursor"] == 600 and streams["windows"].shape == (1, 4, 1025)
    assert [tuple(h.shape) for h in streams["states"]] == [(1, 16, 8)] * 2
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    loaded = load_module(last)
    assert loaded.method == "eggroll"
    greedy = SamplingArgs(max_bytes=6, temperature=0)
    text = generate_bytes(loaded.model, torch.tensor([0]), b"The ", greedy)
    assert len(text) == 6 and text == generate_bytes(loaded.model, torch.tensor([0]), b"The ", greedy)
    with pytest.raises(ConfigError):  # the export format holds the LSTM experts only
        export(str(last), tmp_path / "exported")


def test_a_member_carries_its_state_to_the_next_segment(corpus_dir, tmp_path):
    module = make_cli(_fit_args(corpus_dir, tmp_path, "run")[1:], run=False).model
    windows = torch.randint(0, 256, (1, 4, 1025), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    module.members = range(16)
    first = module.next_segment(windows)
    assert torch.equal(first, windows[..., :301]) and all(not h.any() for h in module.states)
    module.states = [torch.randn_like(h) for h in module.states]
    carried = [h.clone() for h in module.states]
    second = module.next_segment(torch.zeros_like(windows))  # the streams go on reading their windows
    assert torch.equal(second, windows[..., 300:601])
    assert all(torch.equal(a, b) for a, b in zip(module.states, carried, strict=True))
    module.next_segment(windows)
    fresh = module.next_segment(torch.ones_like(windows))  # 900 + 301 > 1,025: new windows, states at zero
    assert torch.equal(fresh, torch.ones_like(windows)[..., :301]) and all(not h.any() for h in module.states)


def test_resume_after_a_crash_mid_window_reaches_the_same_weights_bitwise(corpus_dir, tmp_path):
    run_cli(_fit_args(corpus_dir, tmp_path, "straight"))
    crashed = _fit_args(corpus_dir, tmp_path, "crashed", "--trainer.callbacks+=tests.lit.crash.CrashAtStep",
                        "--trainer.callbacks.step=5")  # checkpoint at step 4: one segment into the second windows
    with pytest.raises(RuntimeError, match="simulated crash at step 5"):
        run_cli(crashed)
    run_cli(_fit_args(corpus_dir, tmp_path, "crashed", "--ckpt_path=last"))
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "crashed")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    streams = [torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False)["streams"]
               for run in ("straight", "crashed")]
    assert all(torch.equal(a, b) for a, b in zip(streams[0]["states"], streams[1]["states"], strict=True))


def test_a_checkpoint_where_new_windows_begin_holds_no_states(corpus_dir, tmp_path):
    run_cli(_fit_args(corpus_dir, tmp_path, "run", "--trainer.max_steps=6", "--trainer.val_check_interval=3"))
    streams = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["streams"]
    assert streams == {"windows": None, "cursor": 0, "states": []}  # cursor 900: the next update takes new ones


def test_chunks_of_members_carry_each_layers_own_state(corpus_dir, tmp_path):
    windows = torch.randint(0, 256, (1, 4, 1025), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    runs = {}
    for chunk in ("6", "16"):  # three loss calls of at most 6 members, or one of all 16
        module = make_cli(_fit_args(corpus_dir, tmp_path, "run", f"--model.init_args.recipe.max_members={chunk}")[1:],
                          run=False).model
        module.members = range(16)
        losses = [module.member_losses(module.next_segment(windows)) for _ in range(2)]
        runs[chunk] = losses, [h.clone() for h in module.states]
    (losses, states), (whole_losses, whole_states) = runs["6"], runs["16"]
    for first, second in zip(losses + states, whole_losses + whole_states, strict=True):
        torch.testing.assert_close(first, second, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(states[0], states[1])  # each layer its own h


@pytest.mark.parametrize(("setting", "value"), [("recipe.alpha", "1.5"), ("recipe.population", "18"),
                                                ("recipe.stream_bytes", "1024")])
def test_bad_recipe_settings_are_refused_naming_them(corpus_dir, tmp_path, setting, value):
    with pytest.raises(ConfigError) as error:
        make_cli(_fit_args(corpus_dir, tmp_path, "run", f"--model.init_args.{setting}={value}")[1:], run=False)
    assert f"model.init_args.{setting}" in str(error.value)


@pytest.mark.parametrize(("option", "setting"), [
    (["--model.init_args.optimizer.momentum=0.9"], "model.init_args.optimizer"),
    (["--data.init_args.batch_size=2"], "data.init_args.batch_size"),
])
def test_a_step_or_batch_the_recipe_cannot_take_is_refused_naming_it(corpus_dir, tmp_path, capsys, option, setting):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(_fit_args(corpus_dir, tmp_path, "run", "--trainer.max_steps=1", *option))
    assert exit_info.value.code == 2
    assert setting in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow  # two fresh interpreters
def test_two_processes_share_the_members_and_train_the_weights_of_one(corpus_dir, tmp_path):
    settings = ["--trainer.max_steps=4", "--trainer.val_check_interval=4"]
    reference = make_cli(_fit_args(corpus_dir, tmp_path, "one", *settings))
    ranks = fit_on_processes(_fit_args(corpus_dir, tmp_path, "two", *settings)[1:], processes=2,
                             dump=tmp_path / "ranks")
    assert max_difference(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    assert max_difference(final_weights(tmp_path / "one"), final_weights(tmp_path / "two")) == 0.0
    # each rank evaluated its 8 of the 16 members, 300 bytes each; every device is charged the step
    assert [r["token_forwards"] for r in ranks] == [8 * 300] * 2
    assert sum(r["token_forwards"] for r in ranks) == reference.model.last_update.token_forwards
    accounting = {run: json.loads(next((tmp_path / run).rglob("compute.json")).read_text())["accounting"]
                  for run in ("one", "two")}
    assert accounting == {"one": "device_per_expert", "two": "every_device"}
