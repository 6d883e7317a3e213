"""`fit --model CLASS --help` prints that class's settings (jsonargparse's `--model.help CLASS`)."""

from __future__ import annotations

import pytest

from soma_pl.cli import class_help, main


def test_model_help_lists_the_modules_own_settings(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--model", "soma_pl.lit.ZOModule", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--model.router_path" in out and "--model.num_experts" in out and "--model.spsa.n_pert" in out
    assert "--trainer.max_steps" not in out  # the module's settings, not the whole subcommand's


@pytest.mark.parametrize("argv,expected", [
    (["fit", "--model", "ZOModule", "--help"], ["fit", "--model.help", "ZOModule"]),
    (["fit", "--config", "a.yaml", "--model=soma_pl.lit.ZOModule", "-h"],
     ["fit", "--config", "a.yaml", "--model.help", "soma_pl.lit.ZOModule"]),
    (["validate", "-h", "--data", "ByteDataModule"], ["validate", "--data.help", "ByteDataModule"]),
])
def test_a_class_with_help_asks_for_that_classs_help(argv, expected):
    assert class_help(argv) == expected


@pytest.mark.parametrize("argv", [
    ["fit", "--model", "ZOModule"],  # no help asked
    ["fit", "--model", "configs/demo/spsa.yaml", "--help"],  # a file, not a class
    ["fit", "--model", "spsa.yaml", "--help"],
    ["fit", "--model={class_path: ZOModule}", "--help"],  # a YAML mapping
    ["fit", "--help", "--model"],
])
def test_other_arguments_pass_unchanged(argv):
    assert class_help(argv) == argv
