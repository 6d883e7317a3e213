"""A sweep file (`sweeps/<name>.yaml`): the base fit config, the search space, seeds and budget.

```yaml
study: table6_lr_eps_demo                # Optuna study name (default: the file name)
config: configs/demo/spsa.yaml           # the fit config (its `base:` layers come with it); a list
                                         # of layers is passed as repeated --config
output_dir: runs/sweeps/table6_lr_eps_demo
seeds: [0, 1]                            # repetitions, not a searched parameter: every configuration runs
                                         # once per seed (--seed_everything, and --model.init_args.seed
                                         # where the module has one)
budget: {token_forwards: 2.0e8}          # -> --budget.token_forwards=... (equal compute per trial)
overrides: {trainer.max_steps: 40}       # fixed for every trial (`sweep --overrides` adds to them)
grid:                                    # factors whose every combination runs
  lr: {key: model.init_args.optimizer.init_args.lr, values: [0.00125, 0.0025]}
  N:
    choices:                             # a label -> overrides; `config` swaps the base config's layers
      1: {config: configs/demo/spsa.yaml}
      2: {config: configs/demo/soma_n2.yaml}
ranges:                                  # continuous factors: sampled by TPE (then `trials` is the count)
  eps: {key: model.init_args.spsa.eps, low: 0.001, high: 0.01, log: true}
trials: 20
pruner: {kind: median, n_startup_trials: 4, n_warmup_steps: 0}
report: {columns: N, baseline: 1}        # Table 6 columns and the Table 7 difference (baseline - other)
first: {eps: 0.0025}                     # a staged grid (Table 6's protocol): the first stage holds these
                                         # factors at these labels; then, per report column and seed, their
                                         # other labels run at the first stage's selection (lowest value)
calibrate: {by: [N], warmup: 3, updates: 10}  # each configuration's update time measured alone before the
                                         # trials, one per label of the `by` factors (those that change an
                                         # update's arithmetic; default: every grid factor), and given to
                                         # every trial as --budget.seconds_per_update (soma_pl.sweeps.calibration);
                                         # `reuse: sweeps/<other>.yaml` takes that sweep's time of the same arithmetic
```
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from soma_pl.analysis.time_basis import CalibrationRun
from soma_pl.config_files import config_args, flatten, read_layers, read_yaml
from soma_pl.errors import ConfigError

Label = int | float | str | bool
"""A grid factor's choice as Optuna stores it (its name in tables)."""
SEED = "seed"
"""A grid point's seed: the trial user attribute (never an Optuna parameter) naming its repetition."""
CONFIG = "config"
"""An override that picks the base fit config instead of setting a key."""
SEED_KEYS = ("seed_everything", "model.init_args.seed")
"""The config keys the runner sets to each of the sweep's `seeds`."""
EXPERTS = "model.init_args.num_experts"
"""The config key of a fit's expert count (1 where no layer sets it)."""


class PrunerKind(str, Enum):
    """Which Optuna pruner stops trials early on their intermediate validation loss."""

    none = "none"
    median = "median"


@dataclass(frozen=True)
class PrunerSpec:
    kind: PrunerKind = PrunerKind.none
    n_startup_trials: int = 4
    """Trials that finish before any is pruned."""
    n_warmup_steps: int = 0
    """Training steps before a trial can be pruned."""


@dataclass(frozen=True)
class Factor:
    """A grid factor: each label maps to the config overrides it stands for."""

    name: str
    choices: dict[Label, dict[str, Any]]

    @property
    def numeric(self) -> bool:
        """Whether the labels are all integers or all floats: an axis of numbers, not of names."""
        return {type(label) for label in self.choices} in ({int}, {float})

    @property
    def log(self) -> bool:
        """Whether a numeric factor's axis is logarithmic: every value positive and the gaps between
        the sorted values widening (lr 0.0125, 0.025, 0.05; N 1, 2, 8, 32, 256), not even (1, 2, 3)."""
        values = sorted(self.choices)
        gaps = [high - low for low, high in itertools.pairwise(values)]
        return values[0] > 0 and all(wider > narrower * (1 + 1e-9) for narrower, wider in itertools.pairwise(gaps))


@dataclass(frozen=True)
class Range:
    """A continuous (or integer) factor sampled by TPE and written to one config key."""

    name: str
    key: str
    low: float
    high: float
    log: bool = False
    integer: bool = False


@dataclass(frozen=True)
class ReportSpec:
    columns: str | None = None
    """Factor across the table's columns (Table 6: N); None: one column."""
    baseline: Label | None = None
    """Column value the Table 7 differences start from (baseline − other); default: the first."""


@dataclass(frozen=True)
class CalibrationSpec:
    """A sweep's calibration: its configurations' update times, each measured alone."""

    by: tuple[str, ...]
    """The grid factors whose labels change an update's arithmetic: one calibration per combination."""
    run: CalibrationRun = CalibrationRun()
    """How each is timed (`warmup`, `updates`: the section's own keys)."""
    reuse: Path | None = None
    """Another sweep whose calibration a configuration takes where that sweep timed the same arithmetic
    (the main job's sides are the selection's trials): both sweeps then stand on one time basis."""


@dataclass(frozen=True)
class SweepSpec:
    """One sweep file, validated. See the module docstring for the YAML."""

    name: str
    path: Path
    config: tuple[str, ...] | None
    """The fit config's layers, passed in order as repeated `--config` (trainer, data, method)."""
    output_dir: Path
    seeds: tuple[int, ...]
    factors: tuple[Factor, ...]
    ranges: tuple[Range, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, float] = field(default_factory=dict)
    trials: int | None = None
    storage: str | None = None
    pruner: PrunerSpec = PrunerSpec()
    report: ReportSpec = ReportSpec()
    wandb: bool = True
    """Pass `--wandb.group=<study> --wandb.name=trial-<n>` to every fit."""
    heartbeat_seconds: float = 10.0
    stale_seconds: float = 60.0
    """A RUNNING trial whose heartbeat is older than this is failed and its point re-run."""
    first: dict[str, Label] = field(default_factory=dict)
    """A staged grid's first stage: these factors held at these labels (empty: one stage)."""
    calibrate: CalibrationSpec | None = None
    """Measure each configuration's update time alone before the trials (None: measured time only)."""

    @property
    def is_grid(self) -> bool:
        """Grid sweeps run each (factor combination, seed) once; range sweeps ask TPE for `trials`."""
        return not self.ranges

    def grid_points(self, selected: dict[tuple, dict[str, Label]] | None = None) -> list[dict[str, Label]]:
        """Every combination of the grid factors' labels, once per seed: `[{factor: label, "seed": seed}]`.
        The seed tells the repetitions apart; it is not a parameter (`point_params`). A staged grid gives
        its first stage, then the second stage of each group (`stage_group`) whose first-stage point
        `selected` holds (None: no second stage): the held factors' other labels, everything else as
        selected."""
        names = [f.name for f in self.factors]
        points = [{**dict(zip(names, labels, strict=True)), SEED: seed}
                  for labels in itertools.product(*(list(f.choices) for f in self.factors)) for seed in self.seeds]
        if not self.first:
            return points
        points = [p for p in points if all(p[name] == label for name, label in self.first.items())]
        return points + [{**best, **later} for best in (selected or {}).values() if best is not None
                         for later in self.later_labels()]

    def later_labels(self) -> list[dict[str, Label]]:
        """The held factors' labels a staged grid's second stage runs (each group's)."""
        held = [f for f in self.factors if f.name in self.first]
        names = [f.name for f in held]
        return [dict(zip(names, labels, strict=True))
                for labels in itertools.product(*(list(f.choices) for f in held))
                if labels != tuple(self.first[name] for name in names)]

    def stage_group(self, point: dict[str, Label]) -> tuple:
        """Which selection a staged grid's point belongs to: its report column's label and its seed."""
        return (point[self.report.columns] if self.report.columns else None, point[SEED])

    def planned_trials(self) -> int:
        """How many trials the sweep runs in all (a staged grid's second stages included)."""
        first = self.grid_points()
        return len(first) + len({self.stage_group(p) for p in first}) * len(self.later_labels())

    def describe(self) -> dict:
        """What the report needs, stored with the study so `sweep report` works without the file."""
        return {"factors": [f.name for f in self.factors], "ranges": [r.name for r in self.ranges],
                "seeds": list(self.seeds), "columns": self.report.columns, "baseline": self.report.baseline,
                "labels": {f.name: list(f.choices) for f in self.factors}, "sweep_file": str(self.path),
                "overrides": json.loads(json.dumps(self.overrides)), "budget": dict(self.budget)}


def point_experts(spec: SweepSpec, point: dict[str, Label]) -> int:
    """How many experts a grid point's fit trains (its overrides, else its config's layers, else 1)."""
    config, overrides = trial_overrides(spec, point)
    experts = overrides.get(EXPERTS)
    for _, settings in read_layers(config_args(config)) if experts is None else ():
        experts = flatten(settings).get(EXPERTS, experts)
    return int(experts or 1)


def point_key(point: dict[str, Label]) -> str:
    """A grid point's identity in the study (canonical JSON)."""
    return json.dumps(point, sort_keys=True)


def point_params(point: dict[str, Label]) -> dict[str, Label]:
    """A grid point's Optuna parameters: its factor labels, without the seed."""
    return {name: label for name, label in point.items() if name != SEED}


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _factor(name: str, raw: Any, where: str) -> Factor:
    raw = _mapping(raw, where)
    if "choices" in raw:
        choices = {label: _mapping(overrides, f"{where}.choices.{label}")
                   for label, overrides in _mapping(raw["choices"], f"{where}.choices").items()}
    elif "key" in raw and isinstance(raw.get("values"), list):
        choices = {value: {raw["key"]: value} for value in raw["values"]}
    else:
        raise ConfigError(f"{where} needs `key` and a `values` list, or `choices` (label -> overrides)")
    if not choices:
        raise ConfigError(f"{where} has no values")
    for label in choices:
        if not isinstance(label, Label):
            raise ConfigError(f"{where}: label {label!r} must be a number, string or boolean")
    return Factor(name, choices)


def _range(name: str, raw: Any, where: str) -> Range:
    raw = _mapping(raw, where)
    unknown = set(raw) - {"key", "low", "high", "log", "int"}
    if unknown or not {"key", "low", "high"} <= set(raw):
        raise ConfigError(f"{where} needs key, low, high (and optional log, int); got {sorted(raw)}")
    if not raw["low"] < raw["high"]:
        raise ConfigError(f"{where}: low {raw['low']} must be below high {raw['high']}")
    return Range(name, raw["key"], float(raw["low"]), float(raw["high"]), bool(raw.get("log", False)),
                 bool(raw.get("int", False)))


KNOWN_KEYS = {"study", "config", "output_dir", "seeds", "grid", "ranges", "overrides", "budget", "trials",
              "storage", "pruner", "report", "wandb", "heartbeat_seconds", "stale_seconds", "first", "calibrate"}


STUDY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A study name: it names files in the output folder (`.<name>.queue.lock`), so it is a name, not a path."""


def study_name(value: Any, path: Path) -> str:
    name = str(value)
    if not STUDY_NAME.fullmatch(name):
        raise ConfigError(f"{path}: study {name!r} is not a name: use letters, digits, `_`, `-` and `.` (not first), "
                          "no `/` or `..`; the study's files go to output_dir")
    return name


def load_sweep(path: str | Path, overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Read and validate a sweep file, with `overrides` (`sweep --overrides`) over its own; bad input
    is one `ConfigError` line naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    raw = _mapping(read_yaml(path, f"sweep file {path}"), str(path))
    unknown = set(raw) - KNOWN_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}")
    name = study_name(raw.get("study") or path.stem, path)
    factors = tuple(_factor(n, f, f"{path}: grid.{n}") for n, f in _mapping(raw.get("grid"), "grid").items())
    ranges = tuple(_range(n, r, f"{path}: ranges.{n}") for n, r in _mapping(raw.get("ranges"), "ranges").items())
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers")
    names = [f.name for f in factors] + [r.name for r in ranges]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: factor names must be unique, got {names}")
    overrides = {**_mapping(raw.get("overrides"), "overrides"), **command_line_overrides(overrides, factors, ranges)}
    _refuse_searched_seed(path, factors, ranges, overrides)
    trials = raw.get("trials")
    if ranges and not (isinstance(trials, int) and trials > 0):
        raise ConfigError(f"{path}: a sweep with ranges needs `trials` (how many TPE trials)")
    report = ReportSpec(**_mapping(raw.get("report"), "report"))
    if report.columns is not None and report.columns not in [f.name for f in factors]:
        raise ConfigError(f"{path}: report.columns '{report.columns}' is not a grid factor")
    spec = SweepSpec(
        name=name, path=path, config=config_layers(raw.get("config"), path), seeds=tuple(seeds), factors=factors,
        ranges=ranges,
        output_dir=Path(raw.get("output_dir") or f"runs/sweeps/{name}"),
        overrides=overrides, budget=_mapping(raw.get("budget"), "budget"),
        trials=trials, storage=raw.get("storage"),
        pruner=PrunerSpec(**{k: PrunerKind(v) if k == "kind" else v
                             for k, v in _mapping(raw.get("pruner"), "pruner").items()}),
        report=report, wandb=bool(raw.get("wandb", True)),
        heartbeat_seconds=float(raw.get("heartbeat_seconds", 10.0)),
        stale_seconds=float(raw.get("stale_seconds", 60.0)), first=_first(raw.get("first"), factors, report, path),
        calibrate=_calibrate(raw.get("calibrate"), factors, path))
    _check_configs(spec)
    return spec


def _first(raw: Any, factors: tuple[Factor, ...], report: ReportSpec, path: Path) -> dict[str, Label]:
    """A staged grid's `first`: grid factors (not the report's columns) held at one of their labels."""
    first = _mapping(raw, "first")
    choices = {f.name: f.choices for f in factors}
    for name, label in first.items():
        if name not in choices or name == report.columns:
            raise ConfigError(f"{path}: first.{name}: a staged grid holds a grid factor other than the report's "
                              f"columns ({report.columns}); grid factors: {sorted(choices)}")
        if label not in choices[name]:
            raise ConfigError(f"{path}: first.{name}={label!r} is not one of grid.{name}'s labels "
                              f"{list(choices[name])}")
    return first


def _calibrate(raw: Any, factors: tuple[Factor, ...], path: Path) -> CalibrationSpec | None:
    """`calibrate:`: `by` names grid factors (default: all of them); `warmup` ≥ 0 and `updates` ≥ 1."""
    if raw is None:
        return None
    settings = dict(_mapping(raw, "calibrate"))
    known = {"by", "reuse", *(f.name for f in dataclasses.fields(CalibrationRun))}
    if unknown := sorted(set(settings) - known):
        raise ConfigError(f"{path}: calibrate.{unknown[0]} is not a calibration setting; known: {sorted(known)}")
    names = [f.name for f in factors]
    by = settings.pop("by", names)
    if not isinstance(by, list) or any(name not in names for name in by):
        raise ConfigError(f"{path}: calibrate.by={by!r} must list grid factors, of {names}")
    reuse = settings.pop("reuse", None)
    if reuse is not None and not isinstance(reuse, str):
        raise ConfigError(f"{path}: calibrate.reuse={reuse!r} must be a sweep file")
    try:
        return CalibrationSpec(by=tuple(by), run=CalibrationRun(**settings), reuse=reuse and Path(reuse))
    except ConfigError as error:
        raise ConfigError(f"{path}: calibrate.{error}") from error


def command_line_overrides(overrides: dict[str, Any] | None, factors: tuple[Factor, ...],
                           ranges: tuple[Range, ...]) -> dict[str, Any]:
    """`sweep --overrides` as dotted keys. A key that a grid factor or a range sets is refused: each
    trial sets it to its own value, which an override would silently replace or be replaced by."""
    flat = flatten(overrides or {})
    searched = {r.key for r in ranges} | {key for f in factors for choice in f.choices.values() for key in choice}
    clash = sorted(set(flat) & searched)
    if clash:
        raise ConfigError(f"--overrides.{clash[0]}: the sweep searches this setting (a grid factor or a range sets it "
                          "for each trial); change its values in the sweep file instead")
    return flat


def _refuse_searched_seed(path: Path, factors: tuple[Factor, ...], ranges: tuple[Range, ...],
                          overrides: dict[str, Any]) -> None:
    """The seed is a repetition (`seeds:`), not a parameter: a grid factor, range or override that
    names or sets it would reach Optuna's importance analysis, or be overwritten by each seed."""
    setting = ([f"grid.{f.name}" for f in factors
                if f.name == SEED or any(key in SEED_KEYS for choice in f.choices.values() for key in choice)]
               + [f"ranges.{r.name}" for r in ranges if r.name == SEED or r.key in SEED_KEYS]
               + [f"overrides.{key}" for key in overrides if key in SEED_KEYS])
    if setting:
        raise ConfigError(f"{path}: {setting[0]} sets the seed, which is not searched: list the seeds under `seeds:` "
                          "(every configuration runs once per seed and the report averages over them)")


def _check_configs(spec: SweepSpec) -> None:
    """Every trial must have a base config, and every named config file must exist."""
    configs = [*(spec.config or ())]
    for factor in spec.factors:
        for choice in factor.choices.values():
            configs.extend(config_layers(choice.get(CONFIG), spec.path) or ())
    for config in configs:
        if not Path(config).is_file():
            raise ConfigError(f"{spec.path}: base config {config} does not exist")
    if spec.config is None and not any(all(CONFIG in o for o in f.choices.values()) for f in spec.factors):
        raise ConfigError(f"{spec.path}: no base `config`, and no grid factor names one for every choice")


def config_layers(value: Any, path: Path) -> tuple[str, ...] | None:
    """A sweep's `config` (one file, or a list of layers passed as repeated `--config`) as a tuple."""
    if value is None:
        return None
    layers = [value] if isinstance(value, str) else value
    if not isinstance(layers, list) or not layers or not all(isinstance(layer, str) for layer in layers):
        raise ConfigError(f"{path}: config must be a file or a non-empty list of files, got {value!r}")
    return tuple(layers)


def trial_overrides(spec: SweepSpec, params: dict[str, Label | float]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The base config's layers and the `{dotted key: value}` overrides for one trial's `params`
    (labels of the grid factors, values of the ranges; the seed is added by the runner)."""
    overrides = dict(spec.overrides)
    for factor in spec.factors:
        overrides.update(factor.choices[params[factor.name]])
    for range_ in spec.ranges:
        overrides[range_.key] = params[range_.name]
    config = overrides.pop(CONFIG, None)
    return (config_layers(config, spec.path) if config is not None else spec.config), overrides

