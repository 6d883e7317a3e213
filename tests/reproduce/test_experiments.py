"""The experiment files of experiments/: each loads, names what exists, and a wrong one is refused."""

from __future__ import annotations

import ast
import inspect
import json
import shutil
import textwrap
from pathlib import Path

import pytest

from soma_pl.cli import COMMANDS
from soma_pl.errors import ConfigError
from soma_pl.eval.bootstrap import Interval
from soma_pl.reproduce.comparisons import check_columns, comparison_checks, sweep_columns
from soma_pl.reproduce.experiments import FOLDER, Claim, all_experiments, load_experiment
from soma_pl.reproduce.verdicts import Verdict
from soma_pl.sweeps.space import load_sweep

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = ["fig10", "fig13", "fig14", "fig4", "fig5", "fig6", "fig7", "fig7_settings", "fig9", "main_job", "table11",
            "table12", "table2", "table3", "table4", "table5", "table7", "table9"]


def test_every_experiment_file_loads_and_names_what_exists():
    found = all_experiments()
    assert sorted(found) == EXPECTED and FOLDER == ROOT / "experiments"
    for name, experiment in found.items():
        assert experiment.name == name and experiment.claims and "cpu" in experiment.scales
        assert bool(experiment.sweeps) != bool(experiment.commands), name
        for sweep in experiment.sweeps.values():
            assert (ROOT / sweep).is_file(), (name, sweep)
        for kind in ("result", "markdown"):
            assert callable(experiment.function(kind)), (name, kind)
        for commands in [*experiment.data.values(), *experiment.commands.values()]:
            for command in commands:
                assert command[0] in COMMANDS or " ".join(command[:2]) in COMMANDS, (name, command)
                configs = [command[i + 1] for i, word in enumerate(command) if word == "--config"]
                assert all((ROOT / config).is_file() for config in configs), (name, command)
        for claim in experiment.claims.values():
            assert claim.split in ("val", "test", "final", "external", "none") and claim.basis


def test_an_experiment_runs_a_sweep_or_commands_not_both_nor_neither(tmp_path):
    text = (FOLDER / "table2.yaml").read_text()
    (tmp_path / "both.yaml").write_text(text + "sweeps: {cpu: sweeps/demo/table4.yaml}\n")
    (tmp_path / "neither.yaml").write_text(text.replace("\ncommands:\n", "\nunused:\n", 1).replace(
        "unused:", "data:", 1))
    for name in ("both", "neither"):
        with pytest.raises(ConfigError) as refused:
            load_experiment(name, tmp_path)
        assert "sweeps" in str(refused.value) and "commands" in str(refused.value)


def test_a_claim_fills_its_fields_and_keeps_its_basis_and_split():
    claim = Claim("N = {larger} below N = {smaller} at {budget:.0f} s", "equal aggregate update time", "val")
    above = Interval(mean=0.2, low=0.1, high=0.3, documents=10, windows=20, p_zero=0.001)
    check = claim.check([0.19, 0.2, 0.21], above, larger=4, smaller=2, budget=119.6)
    assert (check["claim"], check["basis"], check["split"]) == ("N = 4 below N = 2 at 120 s",
                                                                "equal aggregate update time", "val")
    assert check["verdict"] == Verdict.holds.value and check["seeds"] == 3


@pytest.mark.parametrize(("edit", "named"), [
    (lambda text: text + "titel: Table 4\n", "titel"),
    (lambda text: text.replace("    basis: equal update time (each configuration's calibrated alone)\n", "", 1),
     "basis"),
    (lambda text: text.replace("\nsweeps:\n", "\nsweepz:\n", 1), "sweepz"),
])
def test_a_wrong_key_is_refused_naming_it(tmp_path, edit, named):
    path = tmp_path / "table4.yaml"
    path.write_text(edit((FOLDER / "table4.yaml").read_text()))
    with pytest.raises(ConfigError) as refused:
        load_experiment("table4", tmp_path)
    assert named in str(refused.value) and str(path) in str(refused.value)


def test_a_partner_that_is_no_experiment_is_refused_naming_it(tmp_path):
    path = tmp_path / "fig6.yaml"
    path.write_text((FOLDER / "fig6.yaml").read_text().replace("losses: fig14", "losses: fig41"))
    with pytest.raises(ConfigError) as refused:
        load_experiment("fig6", tmp_path)
    assert "losses" in str(refused.value) and "fig41" in str(refused.value) and str(path) in str(refused.value)


def test_a_file_naming_a_missing_function_is_refused_naming_it(tmp_path):
    (tmp_path / "table4.yaml").write_text((FOLDER / "table4.yaml").read_text().replace(
        "module: soma_pl.reproduce.methods", "module: soma_pl.reproduce.tables"))
    with pytest.raises(ConfigError, match="table4_result"):
        load_experiment("table4", tmp_path).function("result")


def test_an_unknown_experiment_or_broken_file_is_refused_naming_it(tmp_path):
    shutil.copy(FOLDER / "table4.yaml", tmp_path / "table4.yaml")
    with pytest.raises(ConfigError) as refused:
        load_experiment("table99", tmp_path)
    assert "table99" in str(refused.value) and "table4" in str(refused.value)
    (tmp_path / "broken.yaml").write_text("title: [unclosed\n")
    with pytest.raises(ConfigError) as refused:
        load_experiment("broken", tmp_path)
    assert str(tmp_path / "broken.yaml") in str(refused.value)


def _claim_keys(function) -> set[str]:
    """The literal keys a result function reads from `….claims[...]` or a local `claims[...]`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.slice.value for node in ast.walk(tree) if isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant) and "claims" in (getattr(node.value, "attr", None),
                                                                       getattr(node.value, "id", None))}


def test_every_claim_a_result_reads_is_declared_in_its_file():
    # checked here, before any trial: a missing key would otherwise surface after the sweep, as a KeyError
    for name, experiment in all_experiments().items():
        read = _claim_keys(experiment.function("result"))
        assert read <= set(experiment.claims), (name, sorted(read - set(experiment.claims)))
    assert _claim_keys(all_experiments()["table2"].function("result")) == {"head", "ensemble", "body"}


def test_a_comparison_needs_both_sides(tmp_path):
    (tmp_path / "fig4.yaml").write_text((FOLDER / "fig4.yaml").read_text().replace("    better: independent\n", ""))
    with pytest.raises(ConfigError) as refused:
        load_experiment("fig4", tmp_path)
    assert "better" in str(refused.value) and str(tmp_path / "fig4.yaml") in str(refused.value)


def _scores(losses: list[float]) -> dict:
    return {"loss": sum(losses) / len(losses), "window_index": [0, 1, 2, 3], "window_losses": losses,
            "doc_ids": ["a", "a", "b", "c"]}


def test_a_declared_comparison_is_checked_on_each_split_against_every_other_column():
    """`worse: others` against `better`: per seed `worse − better`, first on the claim's split, then
    each again on the final split; a column the sweep lacks is refused naming it."""
    experiment = load_experiment("table4")
    shift = {"soma_n2": 0.0, "spsa_32": 0.1, "eggroll": -0.2}
    scores = {split: {label: [_scores([x + s + (0.5 if split == "final" and label != "soma_n2" else 0.0) + 0.01 * seed
                                       for x in (3.0, 3.1, 2.9, 3.2)]) for seed in range(3)]
                      for label, s in shift.items()} for split in ("test", "final")}
    checks = comparison_checks(experiment, scores)
    final = " (final test split, used once)"
    assert [(c["split"], c["claim"]) for c in checks] == [
        ("test", "SOMA N = 2 reaches a lower test loss than Monolithic SPSA (spsa_32)"),
        ("test", "SOMA N = 2 reaches a lower test loss than Monolithic EGGROLL (eggroll)"),
        ("final", "SOMA N = 2 reaches a lower test loss than Monolithic SPSA (spsa_32)" + final),
        ("final", "SOMA N = 2 reaches a lower test loss than Monolithic EGGROLL (eggroll)" + final)]
    assert [round(c["mean"], 6) for c in checks] == [0.1, -0.2, 0.6, 0.3]
    assert checks[0]["document_interval"] == pytest.approx([0.1, 0.1])
    assert [c["verdict"] for c in checks] == [Verdict.holds.value, Verdict.does_not_hold.value,
                                              Verdict.holds.value, Verdict.holds.value]
    del scores["test"]["soma_n2"]
    with pytest.raises(ConfigError) as refused:
        comparison_checks(experiment, scores)
    assert "soma_n2" in str(refused.value) and "table4.yaml" in str(refused.value)


PAIR = """title: A against B
sweeps: {cpu: sweeps/demo/table4.yaml}
basis: equal updates
cost: {cpu: none}
final_test: false
names: {a: Method A}
claims:
  lower: {claim: "b reaches a lower test loss than {name}", basis: equal updates, split: test, worse: a, better: b}
"""


def test_an_experiment_of_comparisons_alone_is_a_file_and_no_module(tmp_path):
    """A sweep and declared comparisons make a whole experiment: the default result, table and figure
    lay out each column's selected runs; a file with a claim of another kind must name its module."""
    (tmp_path / "pair.yaml").write_text(PAIR)
    experiment = load_experiment("pair", tmp_path)
    per_seed, folders, recorded = [], {}, {}
    for seed in range(3):
        trials = {"a": 10 * seed, "b": 10 * seed + 1}
        for label, trial in trials.items():
            record = tmp_path / f"trial-{trial}.json"
            losses = [x + (0.2 if label == "a" else 0.0) + 0.01 * seed for x in (3.0, 3.1, 2.9, 3.2)]
            record.write_text(json.dumps({**_scores(losses), "bootstrap_95": [2.9, 3.3]}))
            folders[trial], recorded[trial] = {seed: str(tmp_path / f"trial-{trial}")}, {seed: str(record)}
        per_seed.append({"seed": seed, "trial": trials, "selected": {"a": {"lr": 0.01}, "b": {"lr": 0.02}}})
    report = {"table7": {"column_labels": ["a", "b"], "per_seed": per_seed, "at_grid_edge": {"b": ["lr"]}},
              "test_score_files": recorded, "trials": {"COMPLETE": 6}, "failed": []}
    result = experiment.result(report, folders)
    (check,) = result["checks"]
    assert check["claim"] == "b reaches a lower test loss than Method A" and check["verdict"] == Verdict.holds.value
    assert check["mean"] == pytest.approx(0.2) and result["trials"] == {"COMPLETE": 6}
    assert [row["test"]["mean"] for row in result["rows"]] == pytest.approx([3.26, 3.06])
    shown = {**result, "experiment": "pair", "scale": "cpu", "title": "t", "basis": "b", "wall_seconds": 1.0,
             "load_average": [0.1, 0.2]}
    text = experiment.table(shown)
    assert "| b† | b | lr=0.02; lr=0.02; lr=0.02 | 3.0600 ± 0.0100 | [2.9000, 3.3000]" in text
    assert "## The paper's claims" in text and "**holds**" in text
    assert experiment.figure(shown, tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")
    (tmp_path / "pair.yaml").write_text(PAIR.replace(", worse: a, better: b", ""))
    with pytest.raises(ConfigError) as refused:
        load_experiment("pair", tmp_path)
    assert "module" in str(refused.value) and str(tmp_path / "pair.yaml") in str(refused.value)


@pytest.mark.parametrize(("edit", "named"), [
    (lambda text: text.replace("worse: a, better: b", "worse: [a, b], better: b"), "better"),
    (lambda text: text.replace("worse: a, better: b", "worse: b, better: others"), "better"),
    (lambda text: text.replace("split: test, worse", "split: val, worse"), "split"),
])
def test_a_comparison_of_a_column_with_itself_or_on_another_split_is_refused(tmp_path, edit, named):
    (tmp_path / "pair.yaml").write_text(edit(PAIR))
    with pytest.raises(ConfigError) as refused:
        load_experiment("pair", tmp_path)
    assert named in str(refused.value) and str(tmp_path / "pair.yaml") in str(refused.value)


def test_every_comparison_names_columns_of_each_of_its_sweeps_and_a_missing_one_is_refused(tmp_path):
    """Checked before any trial (`reproduce` asks the same), at every scale; a result function of a
    module that has comparisons judges them through the one engine."""
    compared = {name: experiment for name, experiment in all_experiments().items()
                if any(claim.better for claim in experiment.claims.values())}
    assert sorted(compared) == ["fig4", "fig9", "main_job", "table4", "table7", "table9"]
    for name, experiment in compared.items():
        for sweep in experiment.sweeps.values():
            check_columns(experiment, sweep_columns(load_sweep(ROOT / sweep)))
        assert "compare_selected(" in inspect.getsource(inspect.getmodule(experiment.function("result"))), name
    (tmp_path / "pair.yaml").write_text(PAIR.replace("worse: a,", "worse: c,"))
    with pytest.raises(ConfigError) as refused:
        check_columns(load_experiment("pair", tmp_path), ["a", "b"])
    assert "'c'" in str(refused.value) and "claims.lower" in str(refused.value)
    assert str(tmp_path / "pair.yaml") in str(refused.value)


@pytest.mark.parametrize("final_test", ["false", "true"])
def test_a_comparison_on_the_final_split_is_checked_once(tmp_path, final_test):
    (tmp_path / "pair.yaml").write_text(PAIR.replace("split: test", "split: final").replace(
        "final_test: false", f"final_test: {final_test}"))
    scores = {"final": {label: [_scores([3.0 + shift + 0.01 * seed] * 4) for seed in range(3)]
                        for label, shift in (("a", 0.1), ("b", 0.0))}}
    (check,) = comparison_checks(load_experiment("pair", tmp_path), scores)
    assert check["split"] == "final" and check["mean"] == pytest.approx(0.1)


def test_a_file_only_experiment_with_a_final_test_shows_and_checks_both_splits(tmp_path):
    """With `final_test`, the default result scores each selected run once on the final split too
    (its record kept in the run folder) and checks the comparison there after the test split."""
    (tmp_path / "pair.yaml").write_text(PAIR.replace("final_test: false", "final_test: true"))
    experiment = load_experiment("pair", tmp_path)
    per_seed, folders = [], {}
    for seed in range(3):
        trials = {"a": 10 * seed, "b": 10 * seed + 1}
        for label, trial in trials.items():
            run = tmp_path / f"trial-{trial}"
            for folder, shift in (("test_windows", 0.2), ("final_test", -0.1)):  # a: worse on test, better on final
                (run / folder / "version_0").mkdir(parents=True)
                losses = [x + (shift if label == "a" else 0.0) + 0.01 * seed for x in (3.0, 3.1, 2.9, 3.2)]
                (run / folder / "version_0" / "test_scores.json").write_text(json.dumps(
                    {**_scores(losses), "bootstrap_95": [2.9, 3.3]}))
            folders[trial] = {seed: str(run)}
        per_seed.append({"seed": seed, "trial": trials, "selected": {"a": {"lr": 0.01}, "b": {"lr": 0.02}}})
    report = {"table7": {"column_labels": ["a", "b"], "per_seed": per_seed}, "trials": {"COMPLETE": 6}, "failed": []}
    result = experiment.result(report, folders)
    assert result["splits"] == ["test", "final"]
    assert [(c["split"], round(c["mean"], 6), c["verdict"]) for c in result["checks"]] == [
        ("test", 0.2, Verdict.holds.value), ("final", -0.1, Verdict.does_not_hold.value)]
    assert [row["final"]["mean"] for row in result["rows"]] == pytest.approx([2.96, 3.06])
    text = experiment.table({**result, "experiment": "pair", "scale": "cpu", "title": "t", "basis": "b",
                             "wall_seconds": 1.0, "load_average": [0.1, 0.2]})
    assert "| test split | final test split (used once) |" in text and "| a | Method A |" in text
