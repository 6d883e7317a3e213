"""`--print_config`, `config.yaml` and W&B show the data settings in use: a data module's recipe's
`dataset:` section (the demo's sizes), not `dataset`'s defaults (the paper's)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from soma_pl.cli import main
from soma_pl.data.preparation.config import recipe_config
from soma_pl.errors import ConfigError
from soma_pl.lightning_cli import make_cli, plain_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART, RECIPE = ROOT / "configs" / "quickstart.yaml", ROOT / "configs" / "data" / "demo.yaml"


def _args(tmp_path, *extra: str) -> list[str]:
    return ["--config", str(QUICKSTART), f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.logger=false",
            f"--data.init_args.prepared={tmp_path / 'data'}", f"--data.init_args.recipe={RECIPE}", *extra]


def test_the_printed_and_logged_config_hold_the_recipes_data_settings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *_args(tmp_path), "--print_config"])
    printed = capsys.readouterr().out
    in_use = asdict(recipe_config(RECIPE, tmp_path / "data"))
    dataset = yaml.safe_load(printed)["data"]["init_args"]["dataset"]
    assert exit_info.value.code == 0 and dataset["val_windows"] == in_use["val_windows"] == 64
    assert {key: dataset[key] for key in ("test_windows", "shard_max_bytes", "output_dir")} == \
        {key: in_use[key] for key in ("test_windows", "shard_max_bytes", "output_dir")}
    cli = make_cli(_args(tmp_path), run=False)  # the data module takes the recipe's settings it is given
    assert asdict(cli.datamodule.dataset) == in_use
    logged = plain_config(cli.parser, cli.config)  # what config.yaml and W&B record
    assert logged["data"]["init_args"]["dataset"]["test_windows"] == 48


def test_a_dataset_set_beside_a_recipe_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.init_args.dataset"):
        make_cli(_args(tmp_path, "--data.init_args.dataset.val_windows=7"), run=False)
