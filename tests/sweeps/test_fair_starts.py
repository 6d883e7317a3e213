"""Every side of a comparison starts the same way and has the same kind of head.

A comparison's sides are the grid choices of a sweep file (each composed as the runner composes it:
the choice's config layers, merged in order, then the sweep's and the choice's overrides), the main
job's (`sweeps/demo/main_job.yaml`) among them. A side starts from random weights or from a seed model; a
seed model is named by its checkpoint path, and the fit command that trains it is written in a config
or sweep file's header. Two seed starts are alike when their commands compose one recipe (the same
config) apart from the width and output folders, and each seed has its side's own width.
"""

from __future__ import annotations

import inspect
import json
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from soma_pl import lit
from soma_pl.config_files import config_args, read_layers
from soma_pl.sweeps.space import SweepSpec, load_sweep, point_params, trial_overrides

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "sweeps").rglob("*.yaml"))
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
WIDTH = "model.init_args.shape.width"
CHECKPOINT = "model.init_args.seed_checkpoint"
OUTPUTS = ("trainer.default_root_dir", "checkpoint.dirpath")
"""Where a fit writes: not part of a seed model's recipe (nor is its width)."""


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _merge(into: dict, layer: dict) -> dict:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _set(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


def _get(config: dict, dotted: str, default=None):
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return default
        config = config[part]
    return config


def compose(layers: tuple[str, ...] | list[str], overrides: dict) -> dict:
    """The fit config of `layers` (merged in order) with dotted `overrides` set."""
    config: dict = {}
    for _, settings in read_layers(config_args([ROOT / layer for layer in layers])):
        _merge(config, settings)
    for key, value in overrides.items():
        _set(config, key, value)
    return config


def _arguments(config: dict) -> tuple[dict, dict]:
    """The module's `init_args` and its constructor's defaults."""
    cls = getattr(lit, config["model"]["class_path"].rpartition(".")[2])
    defaults = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}
    return config["model"].get("init_args") or {}, defaults


def _value(args: dict, defaults: dict, name: str):
    value = args.get(name, defaults.get(name))
    return getattr(value, "value", value)


def width(config: dict) -> int:
    args, defaults = _arguments(config)
    return (args.get("shape") or {}).get("width", defaults["shape"].width)


def seed_checkpoint(config: dict) -> str | None:
    """The checkpoint a fresh fit of `config` starts from; None: random weights (read independently of
    the modules: `init: seed | random`; an unset `init` is `seed` when a checkpoint is named)."""
    args, defaults = _arguments(config)
    key = next((key for key in ("seed_checkpoint", "seed_checkpoint") if key in defaults), None)
    if key is None:  # BPTT: no warm start
        return None
    path = args.get(key)
    init = _value(args, defaults, "init") or ("seed" if path else "random")
    return path if init == "seed" else None


def head_kind(config: dict) -> str:
    """`trainable`, `decoder_only`, `frozen_shared` or `frozen_random` (`ZOModule`'s `head_training`);
    BPTT's shared head is trained: `trainable_shared`."""
    args, defaults = _arguments(config)
    if "head_training" in defaults:
        return _value(args, defaults, "head_training")
    shared = _value(args, defaults, "head") == "shared"
    if not shared:
        return "trainable"
    return "trainable_shared"


def _options(arguments: list[str]) -> tuple[tuple[str, ...], dict]:
    """A fit command's `--config` layers and its other `--key=value` (or `--key value`) settings."""
    layers, options, rest = [], {}, list(arguments)
    while rest:
        key, _, value = rest.pop(0).removeprefix("--").partition("=")
        value = value or rest.pop(0)
        section, _, rest_of_key = key.partition(".")
        if section in ("model", "data") and rest_of_key.split(".")[0] not in ("class_path", "init_args"):
            key = f"{section}.init_args.{rest_of_key}"  # `--model.shape.width`: the CLI's short form
        if key == "config":
            layers.append(value)
        else:
            options[key] = yaml.safe_load(value)
    return tuple(layers), options


def fit_commands(path: Path) -> list[list[str]]:
    """The `python -m soma_pl.cli fit ...` commands of a file's comments (continued lines joined)."""
    text = "\n".join(line.lstrip("#") for line in path.read_text().splitlines() if line.lstrip().startswith("#"))
    marker = "soma_pl.cli fit "
    return [shlex.split(line[line.index(marker) + len(marker):], comments=True)
            for line in text.replace("\\\n", " ").splitlines() if marker in line]


@dataclass(frozen=True)
class Recipe:
    """How a seed model is trained: its fit command's composed config, but for width and output folder."""

    config: str
    """The config as sorted JSON, without `WIDTH` and `OUTPUTS`."""


def recipe(config: dict) -> Recipe:
    stripped = json.loads(json.dumps(config))
    for dotted in (WIDTH, *OUTPUTS):
        *parents, last = dotted.split(".")
        (_get(stripped, ".".join(parents)) or {}).pop(last, None)
    return Recipe(json.dumps({key: value for key, value in stripped.items() if value != {}}, sort_keys=True))


@cache
def seed_recipes() -> dict[str, set[tuple[Recipe, int]]]:
    """Each checkpoint a documented fit command writes (`<folder>/last.ckpt`) → its (recipe, width)s."""
    found: dict[str, set[tuple[Recipe, int]]] = {}
    for path in [*CONFIGS, *SWEEPS]:
        for command in fit_commands(path):
            layers, options = _options(command)
            config = compose(layers, options)
            folder = options.get("checkpoint.dirpath") or f"{_get(config, 'trainer.default_root_dir')}/checkpoints"
            found.setdefault(f"{folder}/last.ckpt", set()).add((recipe(config), width(config)))
    return found


def start(config: dict) -> tuple:
    """`("random",)` or `("seed", recipe)`; the seed must be documented and of the side's own width."""
    path = seed_checkpoint(config)
    if path is None:
        return ("random",)
    recipes = seed_recipes().get(path)
    assert recipes, f"no config or sweep header gives the fit command that trains the seed {path}"
    assert len(recipes) == 1, f"{path} is trained by several recipes: {recipes}"
    ((recipe, seed_width),) = recipes
    assert seed_width == width(config), f"seed {path} has width {seed_width}, its side {width(config)}"
    return ("seed", recipe)


def sweep_sides(spec: SweepSpec) -> dict[str, dict]:
    """Each grid point's (seeds aside) composed fit config, by its point."""
    sides = {}
    for point in spec.grid_points():
        params = point_params(point)
        layers, overrides = trial_overrides(spec, params)
        sides[str(params)] = compose(layers, overrides)
    return sides


def _differing(sides: dict[str, dict], describe) -> dict[str, object]:
    seen = {name: describe(config) for name, config in sides.items()}
    return seen if len(set(seen.values())) > 1 else {}


ABLATION = ROOT / "sweeps" / "demo" / "fig9.yaml"
"""Fig. 9's sweep varies the start and the head on purpose, one condition each (checked below)."""


def _own_recipes(sides: dict[str, dict]) -> dict[str, dict]:
    """The sides of this project's recipes: the EGGROLL authors' GRU recipe (App. I.1, `GRUModule`)
    is its own, from random weights as theirs, beside the paper's warm SPSA monoliths."""
    return {name: config for name, config in sides.items() if not config["model"]["class_path"].endswith("GRUModule")}


@pytest.mark.parametrize("path", [p for p in SWEEPS if p != ABLATION], ids=_name)
def test_the_sides_of_every_sweep_start_the_same_way(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert _differing(_own_recipes(sweep_sides(load_sweep(path))), start) == {}


def _zero_order_sides(sides: dict[str, dict]) -> dict[str, dict]:
    """The sides an SPSA estimator trains: EGGROLL follows its own recipe (App. I.1), whose head the
    evolution strategy perturbs with the body, and BPTT learns its tied head by backprop through both
    its uses, so the paper's SPSA head rules (the delta rule or a frozen seed head) apply to neither."""
    return {name: config for name, config in _own_recipes(sides).items()
            if "eggroll" not in json.dumps(config) and "BPTT" not in config["model"]["class_path"]}


@pytest.mark.parametrize("path", [p for p in SWEEPS if p != ABLATION], ids=_name)
def test_the_sides_of_every_sweep_have_the_same_kind_of_head(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert _differing(_zero_order_sides(sweep_sides(load_sweep(path))), head_kind) == {}


def test_each_fig9_condition_changes_exactly_its_one_thing(monkeypatch):
    """Against the reference (a warm start from the documented width-44 seed, trained heads, semantic
    shards), each condition differs in its start, its head or its shards alone."""
    monkeypatch.chdir(ROOT)
    sides = {str(name).split("'")[3]: config for name, config in sweep_sides(load_sweep(ABLATION)).items()}
    shards = {name: _get(config, "data.init_args.experts_dir") for name, config in sides.items()}
    seen = {name: (start(config)[0], head_kind(config), shards[name]) for name, config in sides.items()}
    reference = ("seed", "trainable", "data/demo-experts-n2")
    assert seen == {"reference": reference, "random_shards": ("seed", "trainable", "data/demo-experts-n2-random"),
                    "global_iid": ("seed", "trainable", "data/demo-experts-n2-iid"),
                    "cold": ("random", "trainable", reference[2]),
                    "decoder_only_head": ("seed", "decoder_only", reference[2]),
                    "frozen_random_head": ("seed", "frozen_random", reference[2])}


FIXED_WIDTH = ["fig7_experts.yaml", "demo/fig7.yaml", "demo/fig7_settings.yaml", "demo/fig13.yaml",
               "demo/table11.yaml", "demo/fig4.yaml"]
"""The fixed-width (d_t = 32) sweeps at both scales (§3: width 32 with one shared frozen head)."""


@pytest.mark.parametrize("name", FIXED_WIDTH)
def test_the_fixed_width_sweeps_give_every_side_one_shared_frozen_head_from_the_width_32_seed(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    sides = sweep_sides(load_sweep(ROOT / "sweeps" / name))
    assert len(sides) >= 2
    assert {head_kind(config) for config in sides.values()} == {"frozen_shared"}
    assert {(start(config)[0], width(config)) for config in sides.values()} == {("seed", 32)}
    # every side at the width-32 sweeps' lr = eps = 1e-3 (§4), the monolith included
    assert {(c["model"]["init_args"]["optimizer"]["init_args"]["lr"], c["model"]["init_args"]["spsa"]["eps"])
            for c in sides.values()} == {(0.001, 0.001)}


def test_the_main_jobs_sides_start_the_same_way_with_the_same_kind_of_head():
    """Each from a seed of its own width trained by one recipe (configs/demo/seed.yaml, App. D)."""
    sides = sweep_sides(load_sweep(ROOT / "sweeps" / "demo" / "main_job.yaml"))
    seed = ("seed", recipe(compose(["configs/demo/seed.yaml"], {})))
    assert {name: (start(config), head_kind(config)) for name, config in sides.items()} == {
        "{'N': 1}": (seed, "decoder_only"), "{'N': 2}": (seed, "decoder_only")}


@pytest.mark.parametrize("path", [p for p in CONFIGS if "class_path" in
                                  ((yaml.safe_load(p.read_text()) or {}).get("model") or {})], ids=_name)
def test_every_method_config_says_how_it_starts(path):
    """An explicit `init`; a seed start names a seed of the model's own width whose command is written down."""
    [*_, (_, content)] = read_layers(["--config", str(path)])
    _, defaults = _arguments(content)
    if not {"seed_checkpoint"} & set(defaults):  # a module that takes no seed starts from random weights
        assert seed_checkpoint(content) is None
        return
    assert content["model"]["init_args"].get("init") in ("seed", "random"), _name(path)
    start(content)


def test_the_paper_scale_comparisons_start_from_seeds_of_one_recipe():
    configs = {name: compose([f"configs/{name}.yaml"], {})
               for name in ("spsa", "soma_n2", "soma_n8", "soma_n256", "eggroll", "ddpp")}
    starts = {name: start(config) for name, config in configs.items()}
    assert {kind for kind, *_ in starts.values()} == {"seed"} and len(set(starts.values())) == 1
    assert {name: seed_checkpoint(config) for name, config in configs.items()} == {
        "spsa": "runs/seed_w509/checkpoints/last.ckpt", "soma_n2": "runs/seed_w361/checkpoints/last.ckpt",
        "soma_n8": "runs/seed_w181/checkpoints/last.ckpt", "soma_n256": "runs/seed_w32/checkpoints/last.ckpt",
        "eggroll": "runs/seed_w509/checkpoints/last.ckpt", "ddpp": "runs/seed_w509/checkpoints/last.ckpt"}


def test_sides_that_start_differently_are_told_apart():
    """The check fails where it should: random against seed, and seeds of another recipe or width."""
    spsa, soma = compose(["configs/spsa.yaml"], {}), compose(["configs/soma_n2.yaml"], {})
    random = compose(["configs/spsa.yaml"], {"model.init_args.init": "random"})
    assert _differing({"spsa": random, "soma": soma}, start)
    # The demo's seed recipe (configs/demo/seed.yaml) against the paper's (configs/seed.yaml).
    cheap = compose(["configs/spsa.yaml"], {WIDTH: 32, CHECKPOINT: "runs/demo_seed_w32/checkpoints/last.ckpt"})
    assert start(cheap)[1] == recipe(compose(["configs/demo/seed.yaml"], {}))
    assert _differing({"cheap": cheap, "soma": soma}, start)
    assert not _differing({"spsa": spsa, "soma": soma}, start)
    wrong_width = compose(["configs/spsa.yaml"], {CHECKPOINT: "runs/seed_w361/checkpoints/last.ckpt"})
    with pytest.raises(AssertionError, match="has width 361, its side 509"):
        start(wrong_width)
    shared = compose(["configs/spsa.yaml"], {"model.init_args.head_training": "frozen_shared"})
    assert _differing({"spsa": spsa, "shared": shared}, head_kind)
