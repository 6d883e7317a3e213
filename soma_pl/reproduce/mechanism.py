"""Fig. 4: the independent-loss mechanism. One SOMA checkpoint continued twice per seed, from the
same weights, Adam moments, data and directions, with each expert's own loss (FSO) or with one
loss summed over its experts before each difference (one perturbation over all their coordinates),
then both scored on the test split. The seed pairs the two arms; the claim is the paper's: the
independent losses end lower."""

from __future__ import annotations

from pathlib import Path

from soma_pl.reproduce.allocation import one_start
from soma_pl.reproduce.comparisons import compare_selected
from soma_pl.reproduce.experiments import Experiment
from soma_pl.reproduce.tables import number, rows_figure, table_head, table_row
from soma_pl.reproduce.verdicts import mean_sd


def fig4_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Each arm's test loss per seed beside the start checkpoint's, and the declared comparison
    (`summed − independent`, paired by seed) checked."""
    per_seed, arms = report["table7"]["per_seed"], experiment.paper["arms"]
    start = one_start([Path(folders[entry["trial"][arm]][entry["seed"]]) for arm in arms for entry in per_seed])
    scores, checks = compare_selected(report, folders, experiment, updates=experiment.paper["cpu_updates"])
    test = {arm: [s["loss"] for s in scores["test"][arm]] for arm in arms}
    independent, summed = test.values()
    rows = [{"arm": arm, "row": arm, "per_seed": {str(e["seed"]): loss for e, loss in zip(per_seed, test[arm],
                                                                                          strict=True)},
             "test": mean_sd(test[arm])} for arm in arms]
    return {"rows": rows, "differences": [s - i for s, i in zip(summed, independent, strict=True)],
            "seeds": [e["seed"] for e in per_seed], "start": start, "checks": checks}


def fig4_markdown(result: dict) -> str:
    paper, seeds = result["paper_summary"], result["seeds"]
    independent, summed = result["rows"]
    lines = [f"Test loss (nats/byte) after {paper['cpu_updates']} further updates from "
             f"`{result['start']['checkpoint']}` "
             f"(test loss {result['start']['test']:.4f} there), per seed; the paper's gains after {paper['updates']:,} "
             f"further updates: {', '.join(f'{g:+.4f}' for g in paper['gains'])}.", "",
             *table_head(["seed", "independent losses", "one summed loss", "summed − independent"])]
    for seed, difference in zip(seeds, result["differences"], strict=True):
        lines.append(table_row([str(seed), number(independent["per_seed"][str(seed)]),
                                number(summed["per_seed"][str(seed)]), number(difference, sign=True)]))
    lines += [table_row(["mean", number(independent["test"]["mean"]), number(summed["test"]["mean"]),
                         number(sum(result["differences"]) / len(result["differences"]), sign=True)]), "",
              f"The paper's later continuation ({paper['mature']}) is not run at this scale."]
    return "\n".join(lines) + "\n"


def fig4_figure(result: dict, path: Path) -> Path:
    return rows_figure(result, path, "test", "test loss (nats/byte)",
                       f"{result['experiment']} at {result['scale']} scale: independent against summed losses")
