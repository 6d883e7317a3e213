"""Every YAML under configs/ (recursively) parses and instantiates through the real CLI parsers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from soma_pl.cli import _prepare_parser
from soma_pl.data.datamodule import ByteDataModule
from soma_pl.lightning_cli import make_cli
from soma_pl.lit.base import ByteLMModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
EXPECTED = 5  # configs/{quickstart,spsa,bptt}.yaml, configs/data/{demo,fineweb_edu}.yaml


def test_found_every_config():
    assert len(CONFIGS) == EXPECTED, [str(c.relative_to(ROOT)) for c in CONFIGS]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_parses(path, monkeypatch):
    content = yaml.safe_load(path.read_text())
    if "dataset" in content:
        parser = _prepare_parser()
        config = parser.instantiate(parser.parse_args(["--config", str(path)]))
        assert config.dataset.output_dir
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = make_cli(["--config", str(path)], run=False)
    assert isinstance(cli.model, ByteLMModule) and isinstance(cli.datamodule, ByteDataModule)
    assert cli.trainer.max_steps > 0
