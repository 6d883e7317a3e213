"""The experiments `reproduce` runs: each names its sweeps, its compute basis, the paper's numbers
and the paper's claims, and turns a sweep report into its result.

A result is a plain dict (written as `results/<name>/result.json`): `rows` of the paper's table
with the paper's numbers beside ours, `blocks` of further tables (the final test split, the other
compute basis), `checks` (each claim's verdict, `soma_pl.reproduce.verdicts`), and `plot` (what the
figure draws).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from soma_pl.eval.bootstrap import Interval, paired_document_interval
from soma_pl.reproduce.ablations import FIG9_PAPER, fig9_figure, fig9_markdown, fig9_result
from soma_pl.reproduce.allocation import (
    FIG13_PAPER,
    TABLE11_PAPER,
    fig13_figure,
    fig13_markdown,
    fig13_result,
    table11_figure,
    table11_markdown,
    table11_result,
)
from soma_pl.reproduce.budgets import TABLE5_PAPER, table5_figure, table5_markdown, table5_result
from soma_pl.reproduce.inference import (
    FIG14_PAPER,
    FIG15_PAPER,
    TABLE13_PAPER,
    fig14_figure,
    fig14_markdown,
    fig14_result,
)
from soma_pl.reproduce.methods import (
    TABLE4_PAPER,
    TABLE9_PAPER,
    table4_figure,
    table4_markdown,
    table4_result,
    table9_figure,
    table9_markdown,
    table9_result,
)
from soma_pl.reproduce.scaling import (
    FIG7_PAPER,
    FIG7_SETTINGS_PAPER,
    fig7_figure,
    fig7_markdown,
    fig7_result,
    fig7_settings_figure,
    fig7_settings_markdown,
    fig7_settings_result,
)
from soma_pl.reproduce.tables import figure, table7_markdown
from soma_pl.reproduce.verdicts import decide, mean_sd
from soma_pl.sweeps.final_test import score_run


@dataclass(frozen=True)
class Experiment:
    """One of the paper's experiments, as `reproduce` runs and reports it."""

    name: str
    title: str
    """What it compares, with the paper's table or figure."""
    sweeps: dict[str, str]
    """Scale (`cpu`, `paper`) → the sweep file whose study it runs."""
    basis: str
    """Which compute is equal between the compared runs, and which other basis is reported beside it."""
    cost: dict[str, str]
    """Scale → what a run costs, as measured (cpu) or as the sweep's budget says (paper)."""
    result: Callable[[dict, dict[int, dict[int, str]]], dict]
    """(sweep report, trial → seed → run folder) → the experiment's result."""
    table: Callable[[dict], str]
    """The result → markdown in the paper's layout, the paper's numbers beside ours."""
    figure: Callable[[dict, Path], Path]
    """(the result, a PNG path) → the figure written there."""
    paper: dict = field(default_factory=dict)
    """The paper's numbers this experiment is reported beside."""
    data: dict[str, list[list[str]]] = field(default_factory=dict)
    """Scale → the commands that make its data before the sweep (`shard` prepares the dataset first; a
    seed model's `fit` resumes its own run with `--ckpt_path=last`, so a finished one is reused)."""
    final_test: bool = True
    """Whether the selected runs are scored on the final test split (used once per run)."""
    workers: int | None = None
    """At most this many sweep workers (None: one per core); 1 where a trial takes every core."""


def demo_shards(*counts: int) -> list[list[str]]:
    """The `shard` commands of the demo corpus's N = 1 sharding (configs/demo/spsa.yaml's data) and
    its N-way semantic shardings (N = 2 is configs/shard/demo_n2.yaml's own folder; others go to
    data/demo-experts-n<N>)."""
    return [["shard", "--config", "configs/shard/demo_n1.yaml"],
            *(["shard", "--config", "configs/shard/demo_n2.yaml",
               *([] if n == 2 else [f"--shard.num_experts={n}", f"--shard.output_dir=data/demo-experts-n{n}"])]
              for n in counts)]


DEMO_SEEDS = [["fit", "--config", "configs/demo/seed.yaml", "--trainer.enable_progress_bar=false", "--ckpt_path=last"],
              ["fit", "--config", "configs/demo/seed.yaml", "--model.shape.width=44",
               "--trainer.default_root_dir=runs/demo_seed_w44", "--checkpoint.dirpath=runs/demo_seed_w44/checkpoints",
               "--trainer.enable_progress_bar=false", "--ckpt_path=last"]]
"""The seed runs of the demo pair (configs/demo/spsa.yaml's width 64, soma_n2.yaml's 44), App. D."""


# Table 7 (the paper's Table 6 caption and rows): test loss after each seed's selection on ensemble
# validation, monolithic SPSA against SOMA N = 2, three optimization seeds (1, 2, 3), nats/byte.
TABLE7_PAPER = {"seeds": [1, 2, 3], "spsa": [2.2641, 2.2666, 2.2576], "soma": [2.2273, 2.2204, 2.2218],
                "difference": [0.0368, 0.0462, 0.0358], "mean": {"spsa": 2.2628, "soma": 2.2232, "difference": 0.0396},
                "sd": {"spsa": 0.0047, "soma": 0.0036, "difference": 0.0057}}
TABLE7_CLAIM = "SOMA (N = 2) reaches a lower test loss than monolithic SPSA after selection on ensemble validation"


def _selected_scores(per_seed: list[dict], folders: dict[int, dict[int, str]], label: str, split: str) -> list[dict]:
    """Each seed's selected run of column `label`, its per-window scores on `split` (scored once, kept
    in the run folder; the trial's own test predates per-window losses in older studies)."""
    return [score_run(Path(folders[entry["trial"][label]][entry["seed"]]), split) for entry in per_seed]


def table7_result(report: dict, folders: dict[int, dict[int, str]]) -> dict:
    """Table 7 beside the paper: per seed, the selected runs' test losses and SPSA − SOMA, on the test
    split and on the final split, and the ensemble-validation difference at equal measured time;
    one check of the paper's claim on each."""
    t7 = report["table7"]
    base, other = str(t7["baseline"]), next(str(c) for c in t7["column_labels"] if str(c) != str(t7["baseline"]))
    per_seed = t7["per_seed"]
    rows = []
    for index, entry in enumerate(per_seed):
        paper = {key: TABLE7_PAPER[key][index] for key in ("spsa", "soma", "difference")} \
            if index < len(TABLE7_PAPER["seeds"]) else {}
        rows.append({"seed": entry["seed"], "ours": {"spsa": entry["test"][base], "soma": entry["test"][other],
                                                     "difference": entry["difference"][other]},
                     "paper": paper, "selected": entry["selected"], "at_grid_edge": entry["at_grid_edge"]})
    summary = {key: mean_sd([row["ours"][key] for row in rows]) for key in ("spsa", "soma", "difference")}
    checks, blocks = [], {}
    for split, label in (("test", "test split"), ("final", "final test split (used once)")):
        if split == "final" and "final_test" not in t7:
            continue
        spsa, soma = (_selected_scores(per_seed, folders, side, split) for side in (base, other))
        differences = [a["loss"] - b["loss"] for a, b in zip(spsa, soma, strict=True)]
        blocks[split] = {"label": label, "per_seed": [{"seed": e["seed"], "spsa": a["loss"], "soma": b["loss"],
                                                       "difference": d, "spsa_95": a["bootstrap_95"],
                                                       "soma_95": b["bootstrap_95"]}
                                                      for e, a, b, d in zip(per_seed, spsa, soma, differences,
                                                                            strict=True)],
                         **{key: mean_sd(values) for key, values in
                            (("spsa", [a["loss"] for a in spsa]), ("soma", [b["loss"] for b in soma]),
                             ("difference", differences))}}
        check = decide(f"{TABLE7_CLAIM} ({label}, equal multiply-adds)", differences,
                       paired_document_interval(spsa, soma))
        checks.append({**check.as_dict(), "basis": "equal multiply-adds", "split": split})
    timed = t7.get("equal_time")
    if timed and "unavailable" not in timed:
        differences = [row["difference"][other] for row in timed["per_seed"]]
        blocks["equal_time"] = {"label": "ensemble validation at equal measured update time",
                                "per_seed": [{"seed": row["seed"], "budget_seconds": row["budget_seconds"],
                                              "total_seconds": row["total_seconds"], "spsa": row["val"][base],
                                              "soma": row["val"][other], "difference": row["difference"][other]}
                                             for row in timed["per_seed"]],
                                "difference": mean_sd(differences)}
        document = (timed.get("document") or {}).get(other)
        check = decide("SOMA (N = 2) reaches a lower ensemble-validation loss than monolithic SPSA at equal measured "
                       "update time (Table 3's basis; validation curves)", differences,
                       None if document is None else Interval(**document))
        checks.append({**check.as_dict(), "basis": "equal measured update time", "split": "val"})
    elif timed:
        blocks["equal_time"] = {"label": "ensemble validation at equal measured update time",
                                "unavailable": timed["unavailable"]}
    return {"labels": {"spsa": base, "soma": other}, "rows": rows, "summary": summary,
            "paper_summary": {"mean": TABLE7_PAPER["mean"], "sd": TABLE7_PAPER["sd"]}, "blocks": blocks,
            "checks": checks, "trials": report["trials"], "failed": report["failed"],
            "at_grid_edge": t7["at_grid_edge"]}


EXPERIMENTS: dict[str, Experiment] = {
    "table7": Experiment(
        name="table7",
        title="Tables 6 → 7: SOMA N = 2 against monolithic SPSA, each seed's learning rate selected on ensemble "
              "validation, then tested",
        sweeps={"cpu": "sweeps/demo/table7_pair.yaml", "paper": "sweeps/table6_lr_eps.yaml"},
        basis="cpu: equal updates of equal multiply-adds (Table 11's basis; 400 updates each), with the same "
              "selections compared at equal measured update time (Table 3's U·Σₑ t̄ₑ, interpolated on the "
              "validation curves) beside it; paper: an equal aggregate GPU-hour budget per trial (Table 3's basis)",
        cost={"cpu": "two seed runs of 1,000 updates (11 minutes on 2 cores), then 36 fits of 400 updates (three "
                     "seeds): about 80 minutes on 2 cores (estimated from 27 measured for one seed's 12)",
              "paper": "30 trials of 1.65 aggregate GPU-hours each (Table 6's five settings per architecture and "
                       "seed, from each architecture's step-1 checkpoint): 49.5 GPU-hours"},
        result=table7_result,
        table=table7_markdown,
        figure=figure,
        paper=TABLE7_PAPER,
        data={"cpu": [*DEMO_SEEDS, *demo_shards(2)],
              "paper": [["shard", "--config", "configs/shard/fineweb_n8.yaml", "--shard.num_experts=2",
                         "--shard.output_dir=data/fineweb_edu-experts-n2"]]},
    ),
    "table4": Experiment(
        name="table4",
        title="Table 4: SOMA N = 2, monolithic SPSA at three n_pert, EGGROLL and DDPP on 2 processes at one equal "
              "budget of measured update time, test loss",
        sweeps={"cpu": "sweeps/demo/table4.yaml", "paper": "sweeps/table4.yaml"},
        basis="equal measured update time (Table 3's U·Σₑ t̄ₑ, every expert and rank counted): cpu: 150 s per run, "
              "the paper's ~150 aggregate GPU-hours in proportion, the runs one at a time; paper: 150 GPU-hours",
        cost={"cpu": "18 fits stopped at 150 s of update time, one at a time: 45 minutes (measured: 30 for 12)",
              "paper": "5 runs of 150 aggregate GPU-hours (DDPP: configs/ddpp.yaml under the same budget, by hand)"},
        result=table4_result,
        table=table4_markdown,
        figure=table4_figure,
        paper=TABLE4_PAPER,
        data={"cpu": demo_shards(2)},
        final_test=False,
        workers=1,
    ),
    "table9": Experiment(
        name="table9",
        title="Table 9: Table 4's checkpoints evaluated frozen on an external text (Melville's Moby-Dick, in place of "
              "WikiText-103)",
        sweeps={"cpu": "sweeps/demo/table4.yaml", "paper": "sweeps/table4.yaml"},
        basis="Table 4's: equal measured update time, each run's last checkpoint (chosen by Table 4's protocol "
              "before any external score exists)",
        cost={"cpu": "Table 4's study (run by `reproduce table4`, reused) and 18 frozen evaluations on 1.2 MB of text: "
                     "under a minute after it (measured: 30 s)",
              "paper": "Table 4's study (`reproduce table4 --scale paper`, reused) and 5 frozen evaluations on "
                       "1.2 MB of text"},
        result=table9_result,
        table=table9_markdown,
        figure=table9_figure,
        paper=TABLE9_PAPER,
        data={"cpu": [*demo_shards(2), ["external-text"]],
              "paper": [["external-text"]]},
        final_test=False,
        workers=1,
    ),
    "table5": Experiment(
        name="table5",
        title="Table 5: SOMA against BPTT at N = 1, 2 and 4 experts, ensemble validation at three budgets of "
              "measured update time",
        sweeps={"cpu": "sweeps/demo/table5.yaml", "paper": "sweeps/table5.yaml"},
        basis="equal measured update time (Table 3's U·Σₑ t̄ₑ), at half, three quarters and all of the runs' budget, "
              "interpolated on each run's validation curve: cpu: 120, 180 and 240 s of one thread, the paper's "
              "50, 75 and 100 GPU-hours in proportion; paper: 50, 75 and 100 GPU-hours, BPTT on 4, 2 and 1 GPUs per "
              "expert (N = 1, 2, 8) and every SOMA expert on a GPU of its own",
        cost={"cpu": "18 fits stopped at 240 s of update time: about 80 core-minutes, 40 minutes on 2 cores "
                     "(estimated from 53 core-minutes measured for two seeds' 12)",
              "paper": "6 runs of 100 aggregate GPU-hours: 600 GPU-hours"},
        result=table5_result,
        table=table5_markdown,
        figure=table5_figure,
        paper=TABLE5_PAPER,
        data={"cpu": demo_shards(2, 4)},
        final_test=False,
    ),
    "fig9": Experiment(
        name="fig9",
        title="Fig. 9: semantic shards against random and global-IID data, warm against cold start, and how the "
              "tied head is trained (the paper's BPTT controls, N = 2)",
        sweeps={"cpu": "sweeps/demo/fig9.yaml"},
        basis="equal updates of equal windows (the figure's training steps; 200 updates each), the seed "
              "model's cost excluded as in the paper",
        cost={"cpu": "18 BPTT fits of 200 updates and a seed model of 1,000 SPSA updates at width 44 (7 "
                     "minutes); the fits not yet measured",
              "paper": "none: the paper gives the controls' batch (512) and conditions, not their model or steps"},
        result=fig9_result,
        table=fig9_markdown,
        figure=fig9_figure,
        paper=FIG9_PAPER,
        data={"cpu": [*demo_shards(2), ["shard", "--config", "configs/shard/demo_n2_random.yaml"],
                      ["shard", "--config", "configs/shard/demo_n2_iid.yaml"], DEMO_SEEDS[1]]},
        final_test=False,
    ),
    "fig7": Experiment(
        name="fig7",
        title="Figs. 7 (left), 8, 16 and 17: fixed-width experts at N = 1, 2, 4 and 8 against elapsed and aggregate "
              "update time; the largest ensemble's top-k curve and pairwise error correlations",
        sweeps={"cpu": "sweeps/demo/fig7.yaml", "paper": "sweeps/fig7_experts.yaml"},
        basis="cpu: equal updates of experts of one width (200 each), so equal elapsed update time per expert "
              "(Fig. 7: U·t̄ₑ, one device per expert) while the aggregate (Fig. 8: U·Σₑ t̄ₑ) grows with N; both read "
              "from measured update time, multiply-adds per update recorded beside them; paper: "
              "sweeps/fig7_experts.yaml stops every N at the figure's common cutoff, 183.6 estimated elapsed hours "
              "(the slowest expert's update time, one GPU per expert)",
        cost={"cpu": "12 fits of 200 updates (N = 1, 2, 4, 8 experts of width 32; three seeds), then two analyses of "
                     "each N = 8 checkpoint: about 77 core-minutes, 39 minutes on 2 cores (estimated from 51 "
                     "core-minutes measured for two seeds)",
              "paper": "5 runs (N = 1, 2, 8, 32, 256) to the paper's common cutoff of 183.6 estimated elapsed hours; "
                       "their shards and width-32 seed model by hand first (sweeps/fig7_experts.yaml's header)"},
        result=fig7_result,
        table=fig7_markdown,
        figure=fig7_figure,
        paper=FIG7_PAPER,
        data={"cpu": demo_shards(2, 4, 8)},
        final_test=False,
    ),
    "fig7_settings": Experiment(
        name="fig7_settings",
        title="Fig. 7 (centre and right): SOMA N = 4 across four n_pert and four effective batches B",
        sweeps={"cpu": "sweeps/demo/fig7_settings.yaml"},
        basis="equal updates (120 each; an update's token-forwards grow with n_pert × B), with the same runs "
              "compared at equal elapsed update time per expert (U·t̄ₑ, the figure's axis) beside it",
        cost={"cpu": "21 fits of 120 updates (N = 4 experts of width 32; three seeds): about 44 core-minutes, 22 "
                     "minutes on 2 cores (estimated from 29 core-minutes measured for two seeds)",
              "paper": "none here: the paper's N = 8 runs reach hundreds of elapsed GPU-hours"},
        result=fig7_settings_result,
        table=fig7_settings_markdown,
        figure=fig7_settings_figure,
        paper=FIG7_SETTINGS_PAPER,
        data={"cpu": demo_shards(4)},
        final_test=False,
    ),
    "fig13": Experiment(
        name="fig13",
        title="Fig. 13 and Table 10: N = 8 experts, three allocations of equal multiply-adds between n_pert and B, "
              "the compute to reach a loss threshold and the loss at three budgets",
        sweeps={"cpu": "sweeps/demo/fig13.yaml"},
        basis="equal multiply-adds per update (n_pert × B = 32 direction-windows); Fig. 13 reads measured aggregate "
              "update time (U·Σₑ t̄ₑ) to the threshold, Table 10 the loss at budgets of multiply-adds",
        cost={"cpu": "9 fits of 80 updates (N = 8 experts of width 32; three seeds): about 45 core-minutes, 24 "
                     "minutes on 2 cores (estimated from 30 core-minutes measured for two seeds)",
              "paper": "none here: the paper's 0.272M curves run for tens of GPU-hours each"},
        result=fig13_result,
        table=fig13_markdown,
        figure=fig13_figure,
        paper=FIG13_PAPER,
        data={"cpu": demo_shards(8)},
        final_test=False,
    ),
    "table11": Experiment(
        name="table11",
        title="Table 11: one N = 8 checkpoint continued under three allocations of equal multiply-adds, test loss",
        sweeps={"cpu": "sweeps/demo/table11.yaml", "paper": "sweeps/table11_alloc.yaml"},
        basis="equal multiply-adds: cpu: 40 further updates of n_pert × B = 32 direction-windows each; paper: 512 "
              "further updates of n_pert × B = 65,536",
        cost={"cpu": "a 100-update start fit (4 minutes), then 9 continuations of 40 updates (three paired seeds; "
                     "about 23 core-minutes): about 16 minutes on 2 cores (estimated from 13 measured for two seeds)",
              "paper": "6 continuations of 512 updates of an N = 8, 0.272M checkpoint at 2,000 updates (two paired "
                       "seeds, lr = eps = 1e-3 held); its start fit by hand first (sweeps/table11_alloc.yaml's "
                       "header)"},
        result=table11_result,
        table=table11_markdown,
        figure=table11_figure,
        paper=TABLE11_PAPER,
        data={"cpu": [*demo_shards(8),
                      ["fit", "--config", "configs/demo/soma_n2.yaml", "--model.num_experts=8",
                       "--data.experts_dir=data/demo-experts-n8", "--model.shape.width=32",
                       "--model.optimizer.lr=0.005", "--model.spsa.micro_batch=1", "--trainer.max_steps=100",
                       "--trainer.val_check_interval=50", "--trainer.default_root_dir=runs/demo_table11_start",
                       "--trainer.enable_progress_bar=false", "--ckpt_path=last"]]},
        final_test=False,
    ),
    "fig14": Experiment(
        name="fig14",
        title="Figs. 14 and 15 and Table 13: fixed-size ensembles of about 144k parameters at N = 1, 2, 4 and 8, the "
              "budget map of their checkpoints and inference arithmetic against test loss",
        sweeps={"cpu": "sweeps/demo/fig14.yaml"},
        basis="equal measured aggregate update time (Table 3's U·Σₑ t̄ₑ): every run stopped at 240 s (N = 8 also at "
              "480 s, about N = 4's elapsed time per expert); Fig. 14 places each checkpoint at its aggregate and "
              "per-expert (aggregate / N) time, Fig. 15 at its multiply-adds per token at inference",
        cost={"cpu": "15 fits (N = 1, 2, 4, 8 to 240 s and N = 8 to 480 s of update time; three seeds): about 90 "
                     "core-minutes, 45 minutes on 2 cores",
              "paper": "none here: the paper's fixed-size N = 256 runs reach 41.9k GPU-hours"},
        result=fig14_result,
        table=fig14_markdown,
        figure=fig14_figure,
        paper={"fig14": FIG14_PAPER, "fig15": FIG15_PAPER, "table13": TABLE13_PAPER},
        data={"cpu": demo_shards(2, 4, 8)},
        final_test=False,
    ),
}
"""Every experiment `reproduce` knows, by name."""
