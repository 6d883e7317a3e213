"""The experiments `reproduce` runs, read from `experiments/<name>.yaml` in the checkout.

Each file is one of the paper's experiments as data: its title, the sweeps it runs at each scale,
its compute basis and cost, the commands that make its data, the paper's numbers and its claims
(each the sentence checked, the basis it is judged on and the split it is scored on). The file
names a module whose `<name>_result`, `<name>_markdown` and `<name>_figure` turn the sweep's report
into the result, its table in the paper's layout and its figure.

A result is a plain dict (written as `results/<name>/result.json`): `rows` of the paper's table
with the paper's numbers beside ours, `blocks` of further tables, `checks` (each claim's verdict,
`soma_pl.reproduce.verdicts`), `paper_summary` (the file's `paper`) and what the figure draws.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from soma_pl.errors import ConfigError
from soma_pl.eval.bootstrap import Interval
from soma_pl.reproduce.verdicts import LEVEL, decide

REPOSITORY = Path(__file__).resolve().parents[2]
"""The checkout whose `experiments/`, `sweeps/`, `configs/`, `data/` and `runs/` the experiments name."""
FOLDER = REPOSITORY / "experiments"


@dataclass(frozen=True)
class Claim:
    """One claim of the paper as an experiment checks it."""

    claim: str
    """The sentence checked, its direction included; `{field}`s are filled from the comparison (its
    N, budget, row label)."""
    basis: str
    """The compute that is equal between the compared sides."""
    split: str
    """The scored split: `val` (ensemble validation), `test`, `final` or `external`."""

    def text(self, **fields) -> str:
        return self.claim.format(**fields)

    def check(self, differences: list[float], document: Interval | None = None, level: float = LEVEL,
              **fields) -> dict:
        """`decide`'s verdict on per-seed differences `worse − better`, as a result's check."""
        return {**decide(self.text(**fields), differences, document, level).as_dict(), "basis": self.basis,
                "split": self.split}


@dataclass(frozen=True)
class Experiment:
    """One of the paper's experiments, as `reproduce` runs and reports it."""

    name: str
    """The file's stem."""
    title: str
    """What it compares, with the paper's table or figure."""
    module: str
    """The module holding `<name>_result`, `<name>_markdown` and `<name>_figure`."""
    sweeps: dict[str, str]
    """Scale (`cpu`, `paper`) → the sweep file whose study it runs."""
    basis: str
    """Which compute is equal between the compared runs, and which other basis is reported beside it."""
    cost: dict[str, str]
    """Scale → what a run costs, as measured (cpu) or as the sweep's budget says (paper)."""
    claims: dict[str, Claim]
    """Key → a claim its result checks."""
    paper: dict = field(default_factory=dict)
    """The paper's numbers this experiment is reported beside."""
    data: dict[str, list[list[str]]] = field(default_factory=dict)
    """Scale → the commands that make its data before the sweep (`shard` prepares the dataset first; a
    seed model's `fit` resumes its own run with `--ckpt_path=last`, so a finished one is reused)."""
    final_test: bool = True
    """Whether the selected runs are scored on the final test split (used once per run)."""

    def function(self, kind: str) -> Callable:
        """The module's `<name>_<kind>` (`result`, `markdown`, `figure`)."""
        try:
            return getattr(importlib.import_module(self.module), f"{self.name}_{kind}")
        except (ImportError, AttributeError) as error:
            raise ConfigError(f"{FOLDER / self.name}.yaml: module {self.module} has no {self.name}_{kind} "
                              f"({type(error).__name__})") from error

    def result(self, report: dict, folders: dict[int, dict[int, str]], **options) -> dict:
        """(sweep report, trial → seed → run folder) → the experiment's result; `options` go to the
        module's function (a test's budgets or text)."""
        return {**self.function("result")(report, folders, self, **options), "paper_summary": self.paper}

    def table(self, result: dict) -> str:
        """The result → markdown in the paper's layout, the paper's numbers beside ours."""
        return self.function("markdown")(result)

    def figure(self, result: dict, path: Path) -> Path:
        """(the result, a PNG path) → the figure written there."""
        return self.function("figure")(result, path)


def _fields(cls: type, entry: object, where: str) -> dict:
    """`entry`'s keys checked against `cls`'s fields: one clear line for a wrong or missing key."""
    names = {f.name for f in dataclasses.fields(cls)} - {"name"}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING} - {"name"}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping of {', '.join(sorted(names))}")
    if unknown := sorted(set(entry) - names):
        raise ConfigError(f"{where}: unknown key '{unknown[0]}'; known: {', '.join(sorted(names))}")
    if missing := sorted(required - set(entry)):
        raise ConfigError(f"{where}: missing key '{missing[0]}'")
    return entry


def load(path: Path) -> Experiment:
    """One experiment file."""
    try:
        entry = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: cannot read it as YAML: {' '.join(str(error).split())}") from error
    entry = _fields(Experiment, entry, str(path))
    claims = {key: Claim(**_fields(Claim, claim, f"{path}: claims.{key}"))
              for key, claim in (entry.get("claims") or {}).items()}
    return Experiment(name=path.stem, **{**entry, "claims": claims})


def all_experiments(folder: Path = FOLDER) -> dict[str, Experiment]:
    """Every experiment file of `folder`, by name."""
    return {path.stem: load(path) for path in sorted(folder.glob("*.yaml"))}


def load_experiment(name: str, folder: Path = FOLDER) -> Experiment:
    """The experiment called `name`."""
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(path.stem for path in sorted(folder.glob("*.yaml"))) or f"none in {folder}"
        raise ConfigError(f"reproduce: unknown experiment '{name}'; known: {known}")
    return load(path)
