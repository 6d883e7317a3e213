"""Config layers: `base:` names the layers a file builds on, and a class's arguments may sit beside
its `class_path`; both become the parser's form before LightningCLI reads them."""

from __future__ import annotations

import pytest
import yaml

from soma_pl.cli import main
from soma_pl.config_files import expand_configs, nested_form, read_layers, warn_on_layer_order
from soma_pl.errors import ConfigError
from soma_pl.lightning_cli import make_cli


def _write(path, content: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return path


def test_arguments_beside_class_path_move_under_init_args():
    shallow = {"class_path": "m.A", "width": 4, "spsa": {"eps": 0.1},
               "optimizer": {"class_path": "torch.optim.SGD", "lr": 0.5},
               "callbacks": [{"class_path": "m.C", "every": 2}, {"class_path": "m.D", "init_args": {"k": 1}}]}
    assert nested_form(shallow, "x") == {"class_path": "m.A", "init_args": {
        "width": 4, "spsa": {"eps": 0.1},
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}},
        "callbacks": [{"class_path": "m.C", "init_args": {"every": 2}}, {"class_path": "m.D", "init_args": {"k": 1}}]}}
    # `model:` and `data:` hold class arguments even without a class_path; other dicts are left alone
    assert nested_form({"batch_size": 2}, "x", subclass=True) == {"init_args": {"batch_size": 2}}
    assert nested_form({"batch_size": 2}, "x") == {"batch_size": 2}
    nested = {"class_path": "m.A", "init_args": {"width": 4}}
    assert nested_form(nested, "x", subclass=True) == nested
    with pytest.raises(ConfigError, match="width is set both beside class_path and under its init_args"):
        nested_form({"class_path": "m.A", "width": 4, "init_args": {"width": 5}}, "x")


def test_bases_come_first_relative_to_their_layer_and_once(tmp_path):
    trainer = _write(tmp_path / "trainer" / "t.yaml", "trainer: {max_steps: 1}\n")
    data = _write(tmp_path / "data" / "d.yaml", "base: ../trainer/t.yaml\ndata: {batch_size: 2}\n")
    method = _write(tmp_path / "methods" / "m.yaml", "base: [../data/d.yaml, ../trainer/t.yaml]\n"
                                                     "model: {class_path: m.A, width: 4}\n")
    layers = read_layers(["--config", str(method)])
    assert [path for path, _ in layers] == [str(trainer), str(data), str(method)]
    assert [settings for _, settings in layers] == [
        {"trainer": {"max_steps": 1}}, {"data": {"init_args": {"batch_size": 2}}},
        {"model": {"class_path": "m.A", "init_args": {"width": 4}}}]
    argv = expand_configs(["--config", str(method), "--trainer.max_steps=3"])
    # a file the parser can read as written goes as its path; one with `base:` or shallow
    # arguments as its settings in the parser's form
    assert argv[:2] == ["--config", str(trainer)] and argv[-1] == "--trainer.max_steps=3"
    assert [yaml.safe_load(text) for text in argv[3:6:2]] == [settings for _, settings in layers[1:]]
    # a base already given before is not read again, so earlier command-line layers keep their place
    again = expand_configs(["--config", str(trainer), "--config", str(data), "--config", str(method)])
    assert again.count(str(trainer)) == 1 and len(again) == 6


@pytest.mark.parametrize("content, message", [
    ("base: missing.yaml\n", r"its base .*missing.yaml does not exist \(a base is relative to the layer's folder\)"),
    ("base: {a: 1}\n", "base must be a file or a list of files"),
    ("base: loop.yaml\n", r"its bases lead back to it \(.*loop.yaml → .*loop.yaml\)"),
])
def test_a_bad_base_is_one_line(tmp_path, content, message):
    layer = _write(tmp_path / "loop.yaml", content)
    with pytest.raises(ConfigError, match=message):
        read_layers(["--config", str(layer)])


def test_a_shallow_layer_runs_the_same_config_as_the_nested_one(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    nested = _write(tmp_path / "nested.yaml", yaml.safe_dump({
        "model": {"class_path": "soma_pl.lit.ZOModule", "init_args": {
            "num_experts": 2, "shape": {"width": 8, "num_layers": 1},
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.3}}}},
        "data": {"class_path": "soma_pl.data.ByteDataModule", "init_args": {"prepared": "data/x", "batch_size": 3}}}))
    shallow = _write(tmp_path / "shallow.yaml", yaml.safe_dump({
        "model": {"class_path": "soma_pl.lit.ZOModule", "num_experts": 2, "shape": {"width": 8, "num_layers": 1},
                  "optimizer": {"class_path": "torch.optim.SGD", "lr": 0.3}},
        "data": {"class_path": "soma_pl.data.ByteDataModule", "prepared": "data/x", "batch_size": 3}}))
    one, other = (make_cli(["--config", str(path)], run=False) for path in (nested, shallow))
    assert one.model.hparams.num_experts == other.model.hparams.num_experts == 2
    assert one.datamodule.batch_size == other.datamodule.batch_size == 3
    assert other.config["model"]["init_args"]["optimizer"]["init_args"]["lr"] == 0.3
    assert one.config["model"] == other.config["model"] and one.config["data"] == other.config["data"]


def test_an_unknown_shallow_key_names_its_file(tmp_path, capsys):
    base = _write(tmp_path / "base.yaml", "trainer: {max_steps: 1}\n")
    layer = _write(tmp_path / "run.yaml", "base: base.yaml\nmodel: {class_path: soma_pl.lit.ZOModule, widht: 8}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(layer)])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "widht" in line and f"set in {layer}" in line and str(base) not in line


def test_a_base_given_again_after_its_method_layer_keeps_its_place_and_warns(tmp_path):
    trainer = _write(tmp_path / "t.yaml", "trainer: {max_steps: 1}\n")
    method = _write(tmp_path / "m.yaml", "base: t.yaml\ntrainer: {max_steps: 5}\nmodel: {class_path: m.A}\n")
    argv = ["--config", str(method), "--config", str(trainer)]
    layers = read_layers(argv)
    assert [path for path, _ in layers] == [str(trainer), str(method), str(trainer)]
    assert expand_configs(argv)[-2:] == ["--config", str(trainer)]  # the parser reads it last: it wins
    changed = r"comes after the method layer .*m.yaml and changes its trainer.max_steps=5 → 1"
    with pytest.warns(UserWarning, match=changed):
        warn_on_layer_order(layers)
