"""Every YAML under configs/ (recursively) parses and instantiates through the real CLI parsers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from soma_pl.cli import command_parser
from soma_pl.config_files import config_args, read_layer
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.lightning_cli import make_cli
from soma_pl.lit.base import ByteLMModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
EXPECTED = 32
# configs/{quickstart,spsa,bptt,seed,soma_quickstart,soma_n2,soma_n8,soma_n256,eggroll,eggroll_gru,ddpp} (11),
# data/{demo,fineweb_edu} (2), shard/{demo_n1,demo_n2,demo_n2_random,demo_n2_iid,demo_n3,fineweb_n8} (6),
# demo/{spsa,soma_n2,bptt_n2,eggroll,eggroll_gru,ddpp,seed} (7) and the seed's variants demo/seed_w{32,44} (2),
# the layers under them: trainer/{cpu,gpu} (2), datamodule/{demo,fineweb_edu} (2)
CPU = ("configs/trainer/cpu.yaml", "configs/datamodule/demo.yaml")
GPU = ("configs/trainer/gpu.yaml", "configs/datamodule/fineweb_edu.yaml")
ON_CPU = {"quickstart", "soma_quickstart"}
"""Method layers composed over the CPU base and the demo corpus (besides configs/demo/*)."""


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _bases(path: Path) -> tuple[str, ...]:
    """The trainer base and data layer a method layer is composed over."""
    return CPU if path.parent.name == "demo" or path.stem in ON_CPU else GPU


def _settings(path: Path | str) -> dict:
    """A layer's own settings in the parser's form (`init_args` under each class)."""
    return read_layer(ROOT / path).settings


def _dump(cli) -> dict:
    config = yaml.safe_load(cli.parser.dump(cli.config, format="yaml", skip_unset=False, skip_check=True))
    config.pop("config", None)
    return config


LAYERS = {ROOT / layer for layer in CPU + GPU}
METHODS = [path for path in CONFIGS if "class_path" in ((yaml.safe_load(path.read_text()) or {}).get("model") or {})]
VARIANTS = [path for path in CONFIGS if {Path(base) for base in read_layer(path).bases} & set(METHODS)]
"""Layers over one method layer that set only a few of its settings (the seed at another width)."""


def _spsa(path: Path) -> bool:
    model = _settings(_name(path))["model"]
    return model["class_path"].endswith("ZOModule") and "eggroll" not in model["init_args"]


SPSA_LAYERS = [path for path in METHODS if _spsa(path)]
"""The zero-order method layers whose estimator is SPSA (monolith, SOMA, DDPP, the seeds and the
quickstarts); EGGROLL's keep their reference's step (configs/eggroll.yaml)."""


def test_found_every_config():
    assert len(CONFIGS) == EXPECTED, [_name(c) for c in CONFIGS]
    assert len(METHODS) == 18 and LAYERS < set(CONFIGS) and len(VARIANTS) == 2 and len(SPSA_LAYERS) == 12


def _flags(settings: dict, prefix: str = "") -> list[str]:
    """A layer's settings as the CLI's `--key=value` flags (`model`'s arguments in the short form)."""
    flags = []
    for key, value in settings.items():
        key = "" if key == "init_args" else key
        dotted = ".".join(part for part in (prefix, key) if part)
        flags += _flags(value, dotted) if isinstance(value, dict) else [f"--{dotted}={value}"]
    return flags


@pytest.mark.parametrize("path", VARIANTS, ids=_name)
def test_a_variant_is_its_method_layer_with_its_few_settings(path, monkeypatch):
    """`fit --config VARIANT` is the run of its method layer with the variant's settings given as
    flags; it names no checkpoint folder (`<default_root_dir>/checkpoints`), and its comment's
    command is that one file."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    (method,) = read_layer(path).bases
    settings = _settings(_name(path))
    assert "checkpoint" not in settings and settings["trainer"]["default_root_dir"].startswith("runs/")
    variant = make_cli(["--config", _name(path)], run=False)
    flagged = make_cli(["--config", str(Path(method).relative_to(ROOT)), *_flags(settings)], run=False)
    assert _dump(variant) == _dump(flagged) != _dump(make_cli(["--config", str(Path(method).relative_to(ROOT))],
                                                              run=False))
    assert f"fit --config {_name(path)}" in path.read_text()


@pytest.mark.parametrize("path", [c for c in CONFIGS if c not in [*METHODS, *VARIANTS, *LAYERS]], ids=_name)
def test_command_config_parses(path):
    content = yaml.safe_load(path.read_text())
    command, section = ("shard", "shard") if "shard" in content else ("prepare", "dataset")
    parser = command_parser(command)
    config = parser.instantiate(parser.parse_args(["--config", str(path)]))
    assert getattr(config, section).output_dir


@pytest.mark.parametrize("path", METHODS, ids=_name)
def test_method_layer_is_one_run(path, monkeypatch):
    """A method layer names its trainer base and data layer under `base:`, so `fit --config LAYER`
    is the whole run, the same config as the three layers given one by one; its comment's command
    is that one file."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    bases = _bases(path)
    assert [str(Path(b).relative_to(ROOT)) for b in read_layer(path).bases] == list(bases)
    cli = make_cli(["--config", _name(path)], run=False)
    assert isinstance(cli.model, ByteLMModule) and isinstance(cli.datamodule, ByteDataModule)
    assert cli.trainer.max_steps > 0
    root = cli.config["trainer"]["default_root_dir"]
    assert root.startswith("runs/") and cli.config["checkpoint"]["dirpath"] == f"{root}/checkpoints"
    assert cli.datamodule.prepared == _settings(bases[1])["data"]["init_args"]["prepared"]
    layered = make_cli(config_args([*bases, _name(path)]), run=False)
    assert _dump(layered) == _dump(cli)
    assert f"fit --config {_name(path)}" in " ".join(path.read_text().replace("\\\n", " ").split())


@pytest.mark.parametrize("path", METHODS, ids=_name)
def test_no_block_is_copied_from_a_base(path):
    """A method layer sets only what differs from its trainer base and data layer; no checkpoint folder
    (it defaults to `<default_root_dir>/checkpoints`); its classes' arguments sit beside `class_path`."""
    content = _settings(_name(path))
    trainer, data = (_settings(layer) for layer in _bases(path))
    assert "checkpoint" not in content and "seed_everything" not in content
    assert "class_path" not in (content.get("data") or {})
    repeated = {k: v for k, v in content["trainer"].items() if trainer["trainer"].get(k, object()) == v}
    data_args = (content.get("data") or {}).get("init_args") or {}
    repeated |= {k: v for k, v in data_args.items() if data["data"]["init_args"].get(k, object()) == v}
    assert repeated == {}
    assert "init_args" not in path.read_text(), "write a class's arguments beside its class_path"


@pytest.mark.parametrize("path", ["configs/seed.yaml", "configs/demo/seed.yaml"])
def test_the_seed_runs_are_the_papers_recipe(path, monkeypatch):
    """§4, App. D: one model trained by zero-order SPSA for 1,000 updates at lr 0.0025 from random
    weights, its head learning only by the delta rule (trained; the update itself, Adam on sparse
    probes with the head never perturbed, is every SPSA layer's: test below); at paper scale
    n_pert = B = 64 on a 10% subset of the corpus."""
    from soma_pl.lit import HeadTraining, ZOModule

    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = make_cli(["--config", path], run=False)
    model, settings = cli.model, cli.config["model"]["init_args"]
    assert isinstance(model, ZOModule) and model.model.num_experts == 1 and model.seed_checkpoint is None
    assert model.head_training is HeadTraining.decoder_only and "head" in model.trainable_parameters()
    assert cli.trainer.max_steps == 1000 and settings["optimizer"]["init_args"]["lr"] == 0.0025
    if path == "configs/seed.yaml":
        assert (settings["spsa"]["n_pert"], cli.datamodule.batch_size, cli.datamodule.train_subset) == (64, 64, 0.1)


@pytest.mark.parametrize("path", SPSA_LAYERS, ids=_name)
def test_every_spsa_layer_steps_the_papers_update(path, monkeypatch):
    """Eq. 8, §4, App. E, I.1: Adam moments with coupled weight decay on the estimate of sparse
    probes, ε starting at the learning rate, and a head that is never perturbed (the delta rule's, or
    one frozen and shared)."""
    from soma_pl.lit.optim import ZOAdam

    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = make_cli(["--config", _name(path)], run=False)
    settings = cli.config["model"]["init_args"]
    assert settings["optimizer"]["class_path"] == f"{ZOAdam.__module__}.ZOAdam"
    assert cli.model.configure_optimizers().defaults["weight_decay"] == 1e-4
    assert settings["spsa"]["direction"] == "sparse" and settings["spsa"]["eps_schedule"] == "proportional"
    assert settings["spsa"]["eps"] == settings["optimizer"]["init_args"]["lr"]
    assert "head" not in cli.model.perturbed_parameters()


PAPER_LR = {"spsa": 0.0025, "ddpp": 0.0025, "soma_n2": 0.0025, "soma_n8": 0.0025, "soma_n256": 1e-3}
"""The paper's starting lr = ε (§4, App. I.1): 1e-3 for the width-32 experts of the main sweeps, 0.0025 for the
wide N = 1, 2, 8 controls (the monolith, and DDPP's one model of its width); the seed's is its own test's."""


@pytest.mark.parametrize("name", sorted(PAPER_LR))
def test_the_paper_scale_layers_start_at_the_papers_learning_rate(name):
    settings = _settings(f"configs/{name}.yaml")["model"]["init_args"]
    assert settings["optimizer"]["init_args"]["lr"] == settings["spsa"]["eps"] == PAPER_LR[name]
