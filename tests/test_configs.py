"""Every YAML under configs/ (recursively) parses and instantiates through the real CLI parsers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from soma_pl.cli import _prepare_parser, _shard_parser
from soma_pl.data.datamodule import ByteDataModule
from soma_pl.lightning_cli import make_cli
from soma_pl.lit.base import ByteLMModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
EXPECTED = 20
# configs/{quickstart,spsa,bptt,seed,soma_quickstart,soma_n2,soma_n8,soma_n256,eggroll,ddpp} (10),
# data/{demo,fineweb_edu} (2), shard/{demo_n2,demo_n3,fineweb_n8} (3), demo/{spsa,soma_n2,bptt_n2,eggroll,ddpp} (5)


def test_found_every_config():
    assert len(CONFIGS) == EXPECTED, [str(c.relative_to(ROOT)) for c in CONFIGS]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_parses(path, monkeypatch):
    content = yaml.safe_load(path.read_text())
    if "shard" in content:
        parser = _shard_parser()
        config = parser.instantiate(parser.parse_args(["--config", str(path)]))
        assert config.shard.output_dir and config.shard.num_experts >= 1
        return
    if "dataset" in content:
        parser = _prepare_parser()
        config = parser.instantiate(parser.parse_args(["--config", str(path)]))
        assert config.dataset.output_dir
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = make_cli(["--config", str(path)], run=False)
    assert isinstance(cli.model, ByteLMModule) and isinstance(cli.datamodule, ByteDataModule)
    assert cli.trainer.max_steps > 0
