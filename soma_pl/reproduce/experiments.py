"""The experiments `reproduce` runs, read from `experiments/<name>.yaml` in the checkout.

Each file is one of the paper's experiments as data: its title, what it runs at each scale, its
compute basis and cost, the commands that make its data, the paper's numbers and its claims (each
the sentence checked, the basis it is judged on and the split it is scored on; a comparison of the
sweep's columns also names them, `worse` and `better`, and `soma_pl.reproduce.comparisons` judges
it). An experiment runs
either a sweep (`sweeps`: trained runs, selected and scored) or commands (`commands`: measurements
at fixed weights, as `analyze params` or `analyze variance`, writing JSON into the result's folder,
named `{folder}` in their arguments). The file names a module (none where every claim is a
declared comparison: `comparisons.selected_*` serve) whose `<name>_result` and
`<name>_markdown` turn the sweep's report (or the commands' folder) into the result and its tables in
the paper's layout, and whose `<name>_figure`, where it has one, draws it; `Experiment.table` puts
the heading, the claims' verdicts and the run's footer around those tables, one way for all.

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
from soma_pl.reproduce.tables import checks_table, commands_footer, heading, run_footer
from soma_pl.reproduce.verdicts import LEVEL, Check, agrees, count, decide, estimate

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
    """The scored split: `val` (ensemble validation), `test`, `final`, `external`, or `none` (a count,
    a timing)."""
    worse: str | list[str] | None = None
    """A comparison's column or columns of the sweep claimed worse (`others`: every column but
    `better`), checked by `soma_pl.reproduce.comparisons`; None for a claim its module checks."""
    better: str | None = None
    """A comparison's column claimed better."""

    def sides(self, columns: list[str]) -> list[str]:
        """The columns compared with `better`, in the sweep's order for `others`."""
        if self.worse == "others":
            return [column for column in columns if column != self.better]
        return self.worse if isinstance(self.worse, list) else [self.worse]

    def on_final(self) -> Claim:
        """The same claim checked again on the final test split (the selected runs scored once)."""
        return dataclasses.replace(self, claim=self.claim + " (final test split, used once)", split="final")

    def text(self, **fields) -> str:
        return self.claim.format(**fields)

    def check(self, differences: list[float], document: Interval | None = None, level: float = LEVEL,
              **fields) -> dict:
        """`decide`'s verdict on per-seed differences `worse − better`, as a result's check."""
        return self.judged(decide(self.text(**fields), differences, document, level))

    def check_estimate(self, value: float, stderr: float, reference: float, draws: int,
                       over: str = "direction draws", **fields) -> dict:
        """`estimate`'s verdict on a quantity measured over independent draws, as a result's check."""
        return self.judged(estimate(self.text(**fields), value, stderr, reference, draws, over))

    def check_agrees(self, value: float, stderr: float, prediction: float, draws: int, margin: float,
                     **fields) -> dict:
        """`agrees`' verdict on a measurement against its prediction within ±`margin`, as a result's check."""
        return self.judged(agrees(self.text(margin=margin, **fields), value, stderr, prediction, draws, margin))

    def check_count(self, ours: int, paper: float, digits: int = 3, **fields) -> dict:
        """`count`'s verdict on an exact count against the paper's, as a result's check."""
        return self.judged(count(self.text(**fields), ours, paper, digits))

    def judged(self, check: Check) -> dict:
        return {**check.as_dict(), "basis": self.basis, "split": self.split}


@dataclass(frozen=True)
class Experiment:
    """One of the paper's experiments, as `reproduce` runs and reports it."""

    name: str
    """The file's stem."""
    title: str
    """What it compares, with the paper's table or figure."""
    basis: str
    """Which compute is equal between the compared runs, and which other basis is reported beside it."""
    cost: dict[str, str]
    """Scale → what a run costs, as measured (cpu) or as the sweep's budget says (paper)."""
    claims: dict[str, Claim]
    """Key → a claim its result checks."""
    module: str | None = None
    """The module holding `<name>_result` and `<name>_markdown`, and `<name>_figure` where it draws one;
    None for an experiment whose claims are all declared comparisons: `comparisons.selected_*` lay
    out each column's selected runs."""
    sweeps: dict[str, str] = field(default_factory=dict)
    """Scale (`cpu`, `paper`) → the sweep file whose study it runs."""
    commands: dict[str, list[list[str]]] = field(default_factory=dict)
    """Scale → the CLI commands it runs instead of a sweep, in order, each writing into `{folder}`."""
    paper: dict = field(default_factory=dict)
    """The paper's numbers this experiment is reported beside."""
    data: dict[str, list[list[str]]] = field(default_factory=dict)
    """Scale → the commands that make its data before the sweep (`shard` prepares the dataset first; a
    seed model's `fit` resumes its own run with `--ckpt_path=last`, so a finished one is reused)."""
    final_test: bool = True
    """Whether the selected runs are scored on the final test split (used once per run)."""
    losses: str | None = None
    """A measurement's partner: the experiment whose saved result gives the losses it is paired with."""
    names: dict[str, str] = field(default_factory=dict)
    """Column → the name a comparison's claim gives it (`{name}`; the column's label where none)."""
    folder: Path = FOLDER
    """The folder of its file (`path`)."""

    @property
    def path(self) -> Path:
        """Its file, which every refusal names."""
        return self.folder / f"{self.name}.yaml"

    @property
    def scales(self) -> dict:
        """Scale → what it runs there (a sweep file or a list of commands)."""
        return self.sweeps or self.commands

    def function(self, kind: str, required: bool = True) -> Callable | None:
        """The module's `<name>_<kind>` (`result`, `markdown`, `figure`); None for a missing one
        not `required`."""
        if self.module is None:
            return getattr(importlib.import_module("soma_pl.reproduce.comparisons"), f"selected_{kind}")
        try:
            module = importlib.import_module(self.module)
        except ImportError as error:
            raise ConfigError(f"{self.path}: module {self.module} cannot be imported "
                              f"({type(error).__name__})") from error
        function = getattr(module, f"{self.name}_{kind}", None)
        if function is None and required:
            raise ConfigError(f"{self.path}: module {self.module} has no {self.name}_{kind}")
        return function

    def result(self, *inputs, **options) -> dict:
        """(sweep report, trial → seed → run folder), or the commands' folder → the experiment's
        result, with the sweep's trial states; `options` go to the module's function (a test's
        budgets or text)."""
        trials = {key: inputs[0][key] for key in ("trials", "failed")} if self.sweeps else {}
        return {**trials, **self.function("result")(*inputs, self, **options), "paper_summary": self.paper}

    def table(self, result: dict) -> str:
        """The result → markdown: its heading, the module's tables in the paper's layout (the paper's
        numbers beside ours), the claims' verdicts, and how the run went."""
        body = self.function("markdown")(result).strip("\n")
        return "\n".join([*heading(result), body, "", "## The paper's claims", "", *checks_table(result["checks"]), "",
                          run_footer(result) if self.sweeps else commands_footer(result)]) + "\n"

    def figure(self, result: dict, path: Path) -> Path | None:
        """(the result, a PNG path) → the figure written there; None for an experiment without one."""
        draw = self.function("figure", required=False)
        return draw and draw(result, path)


def _fields(cls: type, entry: object, where: str) -> dict:
    """`entry`'s keys checked against `cls`'s fields: one clear line for a wrong or missing key."""
    names = {f.name for f in dataclasses.fields(cls)} - {"name", "folder"}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING} - {"name", "folder"}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping of {', '.join(sorted(names))}")
    if unknown := sorted(set(entry) - names):
        raise ConfigError(f"{where}: unknown key '{unknown[0]}'; known: {', '.join(sorted(names))}")
    if missing := sorted(required - set(entry)):
        raise ConfigError(f"{where}: missing key '{missing[0]}'")
    return entry


COMPARED_SPLITS = ("test", "final", "external")
"""The splits a comparison's selected runs are scored on (`soma_pl.reproduce.comparisons`)."""


def _claim(entry: dict, where: str) -> Claim:
    """A claim, a comparison's columns read as the sweep's labels (strings)."""
    if (entry.get("worse") is None) != (entry.get("better") is None):
        raise ConfigError(f"{where}: a comparison needs both 'worse' and 'better'")
    if entry.get("better") is None:
        return Claim(**entry)
    worse = [str(v) for v in entry["worse"]] if isinstance(entry["worse"], list) else str(entry["worse"])
    better = str(entry["better"])
    if better == "others" or better in (worse if isinstance(worse, list) else [worse]) or \
            isinstance(worse, list) and "others" in worse:
        raise ConfigError(f"{where}: better '{better}' must be one column and not among worse ({worse})")
    if entry["split"] not in COMPARED_SPLITS:
        raise ConfigError(f"{where}: split '{entry['split']}': a comparison is scored on one of "
                          f"{', '.join(COMPARED_SPLITS)}")
    return Claim(**{**entry, "worse": worse, "better": better})


def load(path: Path) -> Experiment:
    """One experiment file."""
    try:
        entry = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: cannot read it as YAML: {' '.join(str(error).split())}") from error
    entry = _fields(Experiment, entry, str(path))
    claims = {key: _claim(_fields(Claim, claim, f"{path}: claims.{key}"), f"{path}: claims.{key}")
              for key, claim in (entry.get("claims") or {}).items()}
    if entry.get("losses") and not (path.parent / f"{entry['losses']}.yaml").is_file():
        raise ConfigError(f"{path}: losses: no experiment '{entry['losses']}' in {path.parent}")
    if bool(entry.get("sweeps")) == bool(entry.get("commands")):
        raise ConfigError(f"{path}: give one of 'sweeps' (trained runs) or 'commands' (measurements), not "
                          f"{'both' if entry.get('sweeps') else 'neither'}")
    if not entry.get("module") and not (entry.get("sweeps") and claims and all(c.better for c in claims.values())):
        raise ConfigError(f"{path}: module: name the module of its result and table, or run a sweep and declare "
                          "every claim as a comparison of its columns (worse, better)")
    names = {str(column): name for column, name in (entry.get("names") or {}).items()}
    return Experiment(name=path.stem, folder=path.parent,
                      **{**entry, "claims": claims, "module": entry.get("module") or None, "names": names})


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
