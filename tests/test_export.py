"""`export`: model.safetensors, config.json and a model card, read back without Lightning to the checkpoint's
logits (`ExportedModel.from_pretrained`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import soma_pl
from soma_pl.cli import main
from soma_pl.lit.loading import load_module
from soma_pl.models.checkpoints import load_checkpoint, trained_on
from soma_pl.models.export import EXPORT_FORMAT, ExportedModel, load_exported
from soma_pl.models.router import prefix_batch
from tests.robustness.cli import cli, one_error
from tests.tiny_checkpoints import OTHER_METHODS, PROMPT, ROUTED, module_checkpoint, tiny_checkpoints

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.getbasetemp() / "tiny_checkpoints")


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("exported")
    for method in ("spsa", "soma"):
        main(["export", "--checkpoint", str(getattr(tiny, method)), "--out", str(folder / method)])
    return {method: folder / method for method in ("spsa", "soma")}


def _tokens(experts: int) -> torch.Tensor:
    windows = torch.randint(0, 256, (3, 300), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return windows.unsqueeze(0).expand(experts, -1, -1)


@pytest.mark.parametrize("method", ["spsa", "soma"])
def test_the_export_gives_exactly_the_checkpoints_logits(tiny, exported, method):
    checkpoint = getattr(tiny, method)
    module, loaded = load_module(checkpoint), load_exported(exported[method])
    tokens = _tokens(module.model.num_experts)
    assert torch.equal(loaded(tokens), module.model(tokens))
    windows = torch.cat([prefix_batch([PROMPT]), tokens[0, :, :256]])
    assert torch.equal(loaded.ranking(windows), module.ranking(windows))
    assert (loaded.eval_k, loaded.score_from, loaded.routed) == (module.eval_k, module.score_from, method == "soma")


@pytest.mark.parametrize("method", ["spsa", "soma"])
def test_config_json_describes_the_weights(tiny, exported, method):
    checkpoint = getattr(tiny, method)
    config = json.loads((exported[method] / "config.json").read_text())
    tensors = load_file(exported[method] / "model.safetensors")
    payload = load_checkpoint(checkpoint)
    state = payload["state_dict"]
    assert {name: list(value.shape) for name, value in tensors.items()} == config["tensors"]
    for name, value in tensors.items():  # every expert's weights (and the router's), bit for bit
        assert torch.equal(value, state[name.replace("router.", "routing.router.", 1)]), name
    experts = 2 if method == "soma" else 1
    assert tensors["model.w_hh"].shape[0] == experts and (method == "soma") == ("router.centroids" in tensors)
    assert (config["method"], config["vocab_size"], config["soma_pl_version"]) == (method, 256, soma_pl.__version__)
    assert config["model"] == {"num_experts": experts, "width": 12, "embed_dim": 8, "num_layers": 1,
                               "head": "per_expert", "time_chunk": 64}
    assert config["data"] == trained_on(payload) and len(config["data"]["dataset"]) == 64
    assert config["settings"]["train_context"] == 24 and config["global_step"] == payload["global_step"]
    if method == "soma":
        assert config["router"]["experts"] == 2 and config["data"]["experts"] == config["router"]["sharding"]


def test_loading_an_export_imports_no_lightning(tiny, exported, tmp_path):
    script = ("import sys, torch\n"
              "from soma_pl.models.export import ExportedModel\n"
              f"model = ExportedModel.from_pretrained({str(exported['soma'])!r})\n"
              f"torch.save(model(torch.load({str(tmp_path / 'tokens.pt')!r})), {str(tmp_path / 'logits.pt')!r})\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n")
    torch.save(_tokens(2).clone(), tmp_path / "tokens.pt")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
    module = load_module(tiny.soma)
    assert torch.equal(torch.load(tmp_path / "logits.pt"), module.model(_tokens(2)))


def test_the_model_card_names_the_model_method_data_and_the_runs_scores(tiny, tmp_path):
    run_checkpoint = tiny.spsa.parent / "spsa" / "checkpoints" / "last.ckpt"  # in its run folder, beside summary.json
    summary = json.loads((tiny.spsa.parent / "spsa" / "summary.json").read_text())
    main(["export", "--checkpoint", str(run_checkpoint), "--out", str(tmp_path / "out")])
    card = (tmp_path / "out" / "README.md").read_text()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["scores"]["val/loss"] == summary["metrics"]["val/loss"] and "train/loss" not in config["scores"]
    assert f"| `val/loss` | {summary['metrics']['val/loss']:.4f} |" in card
    assert card.startswith("---\nlibrary_name: soma_pl") and "spsa" in card and str(run_checkpoint) in card
    assert config["data"]["dataset"] in card and '"batch_size": 4' in card and '"n_pert": 4' in card
    model = ExportedModel.from_pretrained(tmp_path / "out")
    tokens = _tokens(1)
    assert torch.equal(model(tokens), load_module(run_checkpoint).model(tokens)) and not model.training


def test_a_card_without_a_run_summary_says_no_scores(exported):
    assert "None recorded" in (exported["spsa"] / "README.md").read_text()
    assert json.loads((exported["spsa"] / "config.json").read_text())["scores"] == {}


@pytest.mark.parametrize("method", sorted(OTHER_METHODS))
def test_every_methods_checkpoint_exports(method, tmp_path):
    torch.manual_seed(0)
    module = OTHER_METHODS[method]().eval()
    checkpoint = module_checkpoint(module, tmp_path / f"{method}.ckpt")
    main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")])
    loaded = load_exported(tmp_path / "out")
    tokens = _tokens(module.model.num_experts)
    assert torch.equal(loaded(tokens), module.model(tokens))
    assert loaded.routed == (method in ROUTED) and loaded.eval_k == module.eval_k
    windows = prefix_batch([PROMPT])
    assert torch.equal(loaded.ranking(windows), module.ranking(windows))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["method"] == method.split("_")[0]


def test_generate_reads_an_export_as_it_reads_the_checkpoint(tiny, exported, tmp_path, capsys):
    (tmp_path / "prompt.txt").write_bytes(PROMPT)
    texts = []
    for source in (tiny.soma, exported["soma"]):
        capsys.readouterr()
        main(["generate", "--checkpoint", str(source), "--prompt_file", str(tmp_path / "prompt.txt"), "--seed", "5",
              "--max_bytes", "40"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 20


def test_an_export_replaces_only_an_export_and_a_failed_one_leaves_the_old(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    main(["export", "--checkpoint", str(tiny.spsa), "--out", str(out)])
    main(["export", "--checkpoint", str(tiny.soma), "--out", str(out)])  # an earlier export is replaced
    assert json.loads((out / "config.json").read_text())["method"] == "soma"

    def fails(folder, *args):
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed while writing")

    monkeypatch.setattr("soma_pl.export.save_exported", fails)
    with pytest.raises(RuntimeError, match="killed while writing"):
        main(["export", "--checkpoint", str(tiny.spsa), "--out", str(out)])
    monkeypatch.undo()
    assert load_exported(out).routed and json.loads((out / "config.json").read_text())["method"] == "soma"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    (out / "notes.txt").write_text("mine")
    one_error(cli(capsys, "export", "--checkpoint", str(tiny.spsa), "--out", str(out)), "notes.txt",
              "soma_pl did not write")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.txt").write_text("mine")
    one_error(cli(capsys, "export", "--checkpoint", str(tiny.spsa), "--out", str(mine)), "soma_pl did not write")
    assert (mine / "data.txt").read_text() == "mine" and (out / "notes.txt").exists()


def test_bad_input_is_one_error_line(tiny, exported, tmp_path, capsys):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    one_error(cli(capsys, "export", "--checkpoint", str(garbage), "--out", str(tmp_path / "a")),
              "unreadable checkpoint", str(garbage))
    payload = torch.load(tiny.soma, map_location="cpu", weights_only=False)
    del payload["router"]
    payload["state_dict"] = {name: value for name, value in payload["state_dict"].items()
                             if not name.startswith("routing.router.")}
    torch.save(payload, tmp_path / "no_router.ckpt")
    one_error(cli(capsys, "export", "--checkpoint", str(tmp_path / "no_router.ckpt"), "--out", str(tmp_path / "b")),
              "carries no router", "--router")
    assert not (tmp_path / "b").exists()
    one_error(cli(capsys, "generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"), "not found")
    one_error(cli(capsys, "generate", "--checkpoint", str(exported["soma"]), "--prompt", "x", "--router",
                  str(tiny.router)), "exported folder", "leave out --config and --router")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"format": EXPORT_FORMAT, "model": {}}))
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\x00" * 16)
    one_error(cli(capsys, "generate", "--checkpoint", str(tmp_path / "broken"), "--prompt", "x"),
              "unreadable", "model.safetensors")
    (tmp_path / "broken" / "config.json").write_text("{")
    one_error(cli(capsys, "generate", "--checkpoint", str(tmp_path / "broken"), "--prompt", "x"),
              "unreadable", "config.json")


def test_evaluate_scores_an_export_as_it_scores_the_checkpoint(tiny, exported, tmp_path, capsys):
    text = tmp_path / "text"
    text.mkdir()
    for index in range(3):
        (text / f"{index}.txt").write_bytes(bytes(range(32, 127)) * (12 + 5 * index))
    reports = []
    for name, source in (("checkpoint", tiny.soma), ("export", exported["soma"])):
        out = tmp_path / f"{name}.json"
        main(["evaluate", "--checkpoint", str(source), "--text", str(text), "--resamples", "10", "--progress", "false",
              "--out", str(out)])
        reports.append(json.loads(out.read_text()))
    assert reports[0]["windows"] == reports[1]["windows"] > 3
    assert reports[1]["window_losses"] == pytest.approx(reports[0]["window_losses"], abs=1e-5)
    assert reports[1]["k"] == reports[0]["k"] and reports[1]["score_from"] == reports[0]["score_from"]
