"""Figures 7 (left), 8, 16 and 17: fixed-width experts at N = 1, 2, 4, 8, against elapsed and
aggregate compute, and the largest ensemble's top-k curve and pairwise error correlations.

Every N trains the same number of updates of experts of one width, so an expert update costs the
same at every N. Each run's ensemble-validation curve is read against its update time (Table 3's
U·Σₑ t̄ₑ: updates × the update time calibrated alone, `soma_pl.analysis.time_basis.update_curve`)
in two ways:

- **elapsed per expert** (Fig. 7): the aggregate divided by N, the elapsed time with one device per
  expert (the paper's "average work per expert");
- **aggregate** (Fig. 8): summed over experts, as one device would spend it.

Multiply-adds per update (token-forwards × parameters per expert) are recorded beside them. The
largest N's last checkpoint of each seed is analysed by `analyze topk` (Fig. 16) and `analyze
error-correlation` (Fig. 17), their JSON kept in `<run>/analysis/`. A comparison of two curves at
a budget has a document interval from the runs' validations window by window (`val_windows/`,
each window interpolated as the mean is); runs without them leave it inconclusive
(`soma_pl.reproduce.verdicts`). Fig. 16 bootstraps its per-window difference; Fig. 17's r has none.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np

from soma_pl.analysis.time_basis import interpolate, update_curve, window_curve
from soma_pl.errors import SomaError
from soma_pl.eval.bootstrap import Interval, document_bootstrap
from soma_pl.reproduce.experiments import Claim, Experiment
from soma_pl.reproduce.tables import number, save_figure, subplots, table_head, table_row
from soma_pl.reproduce.verdicts import LEVEL, Verdict, mean_sd, paired_seeds

FIG8_POINTS = 3
"""Aggregate budgets per pair of expert counts: log-spaced over the range both curves cover."""
MOST = 0.5
"""Fig. 16's "most of the gain": top-k captures more than this share of the best k's gain over k = 1."""


def curve_value(xs: list[float], ys: list[float], at: float, log: bool = True) -> float | None:
    """`ys` at `x = at` on a curve, interpolated linearly in log x (`log`; the figures' time axes: on a
    falling convex curve a chord in linear time would overstate the loss between validations) or in
    x; None outside the curve."""
    if not xs or not xs[0] * (1 - 1e-9) <= at <= xs[-1] * (1 + 1e-9):
        return None
    scale = math.log if log else float
    points = [(scale(x), y) for x, y in zip(xs, ys, strict=True)]
    return interpolate(points, min(max(scale(at), points[0][0]), points[-1][0]))


def _axis(curve: dict, basis: str) -> list[float]:
    """A curve's x values on `basis`: seconds of update time (`per_expert` or `aggregate`), `updates`
    or forward `multiply_adds` (updates × the run's multiply-adds per update)."""
    if basis == "multiply_adds":
        return [updates * curve["multiply_adds_per_update"] for updates in curve["updates"]]
    return curve["updates"] if basis == "updates" else curve[f"{basis}_seconds"]


def _loss_at(curve: dict, basis: str, at: float) -> float | None:
    """A run's loss at `at` on `basis` (`_axis`)."""
    return curve_value(_axis(curve, basis), curve["loss"], at)


@functools.lru_cache(maxsize=256)
def _saved_windows(run_dir: str) -> tuple[list, list, list[np.ndarray]] | None:
    """`window_curve` of a run, read once."""
    return window_curve(Path(run_dir))


def windows_at(curve: dict, basis: str, at: float) -> dict | None:
    """A run's validation windows at `at` on `basis`, each interpolated on its own curve as the mean
    is (their mean is `_loss_at`'s loss), as a scores record for `paired_document_interval`; None
    outside the curve or where the run kept no per-window validations."""
    saved = _saved_windows(curve["run_dir"])
    if saved is None:
        return None
    index, documents, losses = saved
    value = curve_value(_axis(curve, basis), losses, at)
    return None if value is None else {"window_index": index, "window_losses": value, "doc_ids": documents}


def compare_at(worse: list[dict], better: list[dict], basis: str, at: float | None = None, level: float = LEVEL
               ) -> tuple[list[float], Interval | None]:
    """Seed by seed, `worse`'s loss − `better`'s at `at` on `basis`, where both curves reach it (None:
    each at its own last validation), and the document bootstrap of their mean difference window by
    window at `level` (None unless every such seed kept its validations window by window)."""
    losses, windows = [], []
    for side in (worse, better):
        ends = [_axis(curve, basis)[-1] if at is None else at for curve in side]
        losses.append([_loss_at(curve, basis, x) for curve, x in zip(side, ends, strict=True)])
        windows.append([windows_at(curve, basis, x) for curve, x in zip(side, ends, strict=True)])
    return paired_seeds(*losses, *windows, level=level)


def run_curve(run_dir: Path) -> dict:
    """One run's curve on both time bases, with its size and arithmetic per update."""
    summary = json.loads((run_dir / "summary.json").read_text())
    compute = summary["compute"]
    experts = int(compute["experts"])
    updates = max(int(compute["updates"]), 1)
    per_expert = summary["parameters"] / experts
    points = update_curve(run_dir)
    return {"experts": experts, "parameters": summary["parameters"], "parameters_per_expert": per_expert,
            "multiply_adds_per_update": compute["token_forwards"] / updates * per_expert,
            "updates": [step for step, _, _ in points], "loss": [loss for _, loss, _ in points],
            "aggregate_seconds": [seconds for _, _, seconds in points],
            "per_expert_seconds": [seconds / experts for _, _, seconds in points],
            "last_checkpoint": summary.get("last_checkpoint"), "run_dir": str(run_dir)}


def elapsed_checks(curves: dict[int, list[dict]], claim: Claim) -> tuple[float, list[dict]]:
    """Fig. 7 (left): at the common per-expert cutoff (the shortest run's elapsed time, as the paper's
    common 183.6-hour cutoff), each larger N against the next smaller one, seed by seed."""
    cutoff = min(c["per_expert_seconds"][-1] for runs in curves.values() for c in runs)
    counts, checks = sorted(curves), []
    for smaller, larger in zip(counts, counts[1:], strict=False):
        differences, document = compare_at(curves[smaller], curves[larger], "per_expert", cutoff)
        checks.append(claim.check(differences, document, larger=larger, smaller=smaller, cutoff=cutoff))
    return cutoff, checks


def aggregate_comparisons(curves: dict[int, list[dict]], claim: Claim, points: int = FIG8_POINTS) -> list[dict]:
    """Fig. 8: each larger N against the next smaller one at `points` log-spaced aggregate budgets
    over the range both cover; the difference is larger − smaller (positive: more experts worse).
    At equal aggregate time a larger N has made fewer updates per expert (smaller/larger as many),
    so early budgets favour fewer experts by construction; where the curves cross (the last budgets)
    is what the figure shows, and Fig. 8's claim reads the budgets in the later half of each range
    in log time (`later_half`). That claim rests on all of those comparisons, so each interval (over
    seeds and over documents) is at the Bonferroni level 1 − 0.05 / comparisons."""
    counts, rows = sorted(curves), []
    pairs = sum(1 for smaller, larger in zip(counts, counts[1:], strict=False))
    later = [2 * i >= points - 1 for i in range(points)]
    level = 1 - (1 - LEVEL) / max(pairs * sum(later), 1)
    for smaller, larger in zip(counts, counts[1:], strict=False):
        both = curves[smaller] + curves[larger]
        start = max(c["aggregate_seconds"][0] for c in both)
        end = min(c["aggregate_seconds"][-1] for c in both)
        if start > end:
            continue
        budgets = [start * (end / start) ** (i / max(points - 1, 1)) for i in range(points)]
        for budget, later_half in zip(budgets, later, strict=True):
            low = [_loss_at(c, "aggregate", budget) for c in curves[smaller]]
            high = [_loss_at(c, "aggregate", budget) for c in curves[larger]]
            differences, document = compare_at(curves[larger], curves[smaller], "aggregate", budget, level)
            check = claim.check(differences, document, level, larger=larger, smaller=smaller, budget=budget)
            rows.append({"smaller": smaller, "larger": larger, "budget_seconds": budget, "later_half": later_half,
                         "smaller_loss": low, "larger_loss": high, "check": check})
    return rows


def aggregate_check(rows: list[dict], claim: Claim) -> dict:
    """Fig. 8's claim over the comparisons in the later half (in log time) of each pair's common
    range (`later_half`): it holds when more experts are decisively worse at one of those budgets,
    does not hold when they are decisively better at every one, and is inconclusive otherwise. The
    earlier budgets are left out because they cannot go against the claim: at equal aggregate time a
    larger N has made fewer updates per expert, so the first budgets favour fewer experts by
    construction. The numbers shown (and the p-value Holm adjusts) are the holding comparison with
    the smallest p-value, the opposite comparison with the largest where every one goes the other
    way, else the comparison most in the claim's favour (a selection among several: read its
    interval with that in mind)."""
    rows = [row for row in rows if row["later_half"]]
    if not rows:
        return claim.check([])
    verdicts = [Verdict(row["check"]["verdict"]) for row in rows]
    best = max(rows, key=lambda row: row["check"]["mean"] if row["check"]["mean"] is not None else -math.inf)
    if Verdict.holds in verdicts:
        verdict = Verdict.holds
        best = min((r for r in rows if r["check"]["verdict"] == Verdict.holds.value), key=lambda r: r["check"]["p"])
    elif all(v is Verdict.does_not_hold for v in verdicts):
        verdict = Verdict.does_not_hold
        best = max(rows, key=lambda row: row["check"]["p"])
    else:
        verdict = Verdict.inconclusive
    check = best["check"]
    held = sum(v is Verdict.holds for v in verdicts)
    why = (f"{held} of {len(rows)} (pair, budget) comparisons hold, "
           f"{sum(v is Verdict.does_not_hold for v in verdicts)} show the opposite; shown: N = {best['larger']} "
           f"against N = {best['smaller']} at {best['budget_seconds']:.0f} s ({check['why']})")
    return {**check, "claim": claim.text(), "basis": claim.basis, "verdict": verdict.value, "why": why}


def _analysis(run_dir: Path, name: str) -> dict:
    """`analyze topk` or `analyze error-correlation` of the run's last checkpoint on the ensemble-
    validation set of the dataset it trained on, once (kept in `<run>/analysis/<name>.json`; its
    stdout in `<name>.log`)."""
    import yaml

    from soma_pl.analysis import error_correlation, topk

    saved = run_dir / "analysis" / f"{name}.json"
    if not saved.is_file():
        data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["init_args"]["prepared"]
        saved.parent.mkdir(parents=True, exist_ok=True)
        command = topk.main if name == "topk" else error_correlation.main
        checkpoint = json.loads((run_dir / "summary.json").read_text())["last_checkpoint"]
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            command(checkpoint, data=data, out=str(saved), progress=False)
        (saved.with_suffix(".log")).write_text(printed.getvalue())
    return json.loads(saved.read_text())


def topk_check(curves: list[dict], k: int, claim: Claim) -> dict:
    """Fig. 16: top-`k` captures most (> `MOST`) of the gain of each seed's best k over k = 1, judged
    on (L₁ − L_k) − MOST·(L₁ − L_best) in nats/byte: per seed, and per window averaged over seeds
    and bootstrapped over documents. Its sign is that of the share − MOST, but where the best k
    gains little over k = 1 (a thousandth of a nat) a share is a ratio of two small numbers and its
    interval over seeds says nothing; the difference stays on the scale of the losses."""
    differences, windows, documents = [], [], None
    for curve in curves:
        loss = curve["loss_by_k"]
        best = int(np.argmin(loss))
        differences.append((loss[0] - loss[k - 1]) - MOST * (loss[0] - loss[best]))
        by_k = np.asarray(curve["window_loss_by_k"])
        windows.append((by_k[:, 0] - by_k[:, k - 1]) - MOST * (by_k[:, 0] - by_k[:, best]))
        if documents is not None and list(curve["doc_ids"]) != list(documents):
            raise SomaError("Fig. 16: the seeds' top-k analyses scored different windows; run them on one dataset")
        documents = curve["doc_ids"] if documents is None else documents
    interval = document_bootstrap(np.mean(windows, axis=0), np.asarray(documents))
    return claim.check(differences, interval, k=k, most=MOST)


def correlation_check(analyses: list[dict], claim: Claim) -> dict:
    """Fig. 17: across expert pairs, the gain of averaging a pair falls as their residual error
    correlation rises (a negative Pearson r): the seeds' −r, with no document interval (the analysis
    keeps no per-window r), so the check stays inconclusive."""
    return claim.check([-a["gain_correlation_pearson"] for a in analyses])


def fig7_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Figs. 7 (left), 8, 16 and 17 beside the paper's claims."""
    t7 = report["table7"]
    per_seed = t7["per_seed"]
    labels = sorted((str(label) for label in t7["column_labels"]), key=int)
    run_dirs = {int(label): [Path(folders[entry["trial"][label]][entry["seed"]]) for entry in per_seed]
                for label in labels}
    curves = {n: [run_curve(path) for path in paths] for n, paths in run_dirs.items()}
    claims = experiment.claims
    cutoff, checks = elapsed_checks(curves, claims["elapsed"])
    aggregate = aggregate_comparisons(curves, claims["aggregate_budget"])
    checks.append(aggregate_check(aggregate, claims["aggregate"]))
    largest = max(curves)
    k = min(4, max(1, largest // 2))
    topks = [_analysis(path, "topk") for path in run_dirs[largest]]
    correlations = [_analysis(path, "error_correlation") for path in run_dirs[largest]] if largest >= 3 else []
    if largest >= 2:
        checks.append(topk_check(topks, k, claims["topk"]))
    if correlations:
        checks.append(correlation_check(correlations, claims["correlation"]))
    rows = []
    for n, runs in curves.items():
        at_cutoff = [_loss_at(c, "per_expert", cutoff) for c in runs]
        first = runs[0]
        rows.append({"experts": n, "parameters_per_expert": first["parameters_per_expert"],
                     "parameters": first["parameters"], "multiply_adds_per_update": first["multiply_adds_per_update"],
                     "updates": first["updates"][-1], "at_cutoff": mean_sd([v for v in at_cutoff if v is not None]),
                     "final": mean_sd([c["loss"][-1] for c in runs]),
                     "per_expert_seconds": mean_sd([c["per_expert_seconds"][-1] for c in runs]),
                     "aggregate_seconds": mean_sd([c["aggregate_seconds"][-1] for c in runs])})
    return {"rows": rows, "cutoff_seconds": cutoff, "curves": {str(n): runs for n, runs in curves.items()},
            "aggregate": aggregate, "largest": largest, "top_k": k,
            "topk": [{key: t[key] for key in ("k", "loss_by_k", "loss_by_k_bootstrap_95", "best_k", "expert_losses",
                                              "windows", "documents")} for t in topks],
            "error_correlation": [{key: c[key] for key in ("experts", "tokens", "bins", "gain_correlation_pearson",
                                                           "pairs")} for c in correlations],
            "checks": checks, "seeds": [e["seed"] for e in per_seed]}


def fig7_markdown(result: dict) -> str:
    """Four blocks: the runs at the common elapsed cutoff (Fig. 7), the aggregate comparisons (Fig. 8),
    the top-k curve (Fig. 16) and the error-correlation bins (Fig. 17); then the claims."""
    paper = result["paper_summary"]
    seeds = ", ".join(map(str, result["seeds"]))
    lines = ["## Fig. 7 (left): ensemble-validation loss against elapsed time per expert", "",
             f"Mean ± sd over seeds {seeds} (nats/byte), interpolated in log time at the common cutoff of "
             f"{result['cutoff_seconds']:.1f} s of update time per expert (U·t̄ₑ, one thread; the paper's "
             f"common cutoff: {paper['cutoff']}; its N: {', '.join(map(str, paper['experts']))}). Multiply-adds per "
             "update: token-forwards × parameters per expert.", "",
             *table_head(["N", "parameters per expert", "ensemble parameters", "multiply-adds per update", "updates",
                          "at the cutoff", "final", "s per expert (final)", "s aggregate (final)"])]
    for row in result["rows"]:
        stat = row["at_cutoff"]
        lines.append(table_row([str(row["experts"]), f"{row['parameters_per_expert']:,.0f}", f"{row['parameters']:,}",
                                f"{row['multiply_adds_per_update']:.3g}", str(row["updates"]),
                                f"{number(stat['mean'])} ± {number(stat['sd'])}",
                                f"{number(row['final']['mean'])} ± {number(row['final']['sd'])}",
                                f"{row['per_expert_seconds']['mean']:.0f}", f"{row['aggregate_seconds']['mean']:.0f}"]))
    lines += ["", "## Fig. 8: the same runs against aggregate update time", "",
              "Each larger N against the next smaller one at log-spaced budgets of aggregate update time "
              "(U·Σₑ t̄ₑ) over the range both curves cover, interpolated in log time; difference = larger N − smaller "
              "N (positive: more experts worse at that budget). At equal aggregate time a larger N has made fewer "
              "updates per expert, so the early budgets favour fewer experts by construction and the claim reads only "
              "the later half of each pair's range (in log time); the last budget of each pair is where the curves "
              "cross, if they do. One claim rests on all the comparisons, so each seed interval is at the "
              "Bonferroni level (95% shared among them).", "",
              *table_head(["pair", "aggregate budget (s)", "smaller N", "larger N", "difference", "verdict"])]
    for row in result["aggregate"]:
        check = row["check"]
        small, large = ([v for v in row[key] if v is not None] for key in ("smaller_loss", "larger_loss"))
        lines.append(table_row([f"N = {row['smaller']} → {row['larger']}", f"{row['budget_seconds']:.0f}",
                                number(statistics.fmean(small) if small else None),
                                number(statistics.fmean(large) if large else None),
                                number(check["mean"], sign=True), check["verdict"]]))
    if result["topk"]:
        lines += ["", f"## Fig. 16: top-k on N = {result['largest']}'s last checkpoints", "",
                  f"Ensemble-validation loss (nats/byte) for each k, per seed ({seeds}), with the 95% document-"
                  f"bootstrap interval; the dashed line of the paper's figure is k = {result['top_k']}.", "",
                  *table_head(["k", *(f"seed {s}" for s in result["seeds"])])]
        for index, k in enumerate(result["topk"][0]["k"]):
            lines.append(table_row([str(k), *(f"{number(t['loss_by_k'][index])} "
                                              f"[{number(t['loss_by_k_bootstrap_95'][index][0])}, "
                                              f"{number(t['loss_by_k_bootstrap_95'][index][1])}]"
                                              for t in result["topk"])]))
    if result["error_correlation"]:
        lines += ["", f"## Fig. 17: pairs of N = {result['largest']}'s experts", "",
                  "Residual error correlation (shared token difficulty removed) against the gain of averaging the pair "
                  "(mean loss of the two alone − loss of their average, nats/byte), in equal-count bins, per seed; "
                  "r: Pearson over all pairs.", ""]
        for seed, analysis in zip(result["seeds"], result["error_correlation"], strict=True):
            r = analysis["gain_correlation_pearson"]
            lines += [f"Seed {seed}: {len(analysis['pairs'])} pairs, r = {r:+.3f}.", "",
                      *table_head(["correlation", "gain", "pairs"])]
            lines += [table_row([f"{b['correlation']:+.3f}", f"{b['gain']:+.4f} ± {b['gain_stderr']:.4f}",
                                 str(b["pairs"])]) for b in analysis["bins"]]
            lines.append("")
    lines += ["", "The paper's statements:", "", *(f"- {paper[key]} (paper, {key.replace('fig', 'Fig. ')})"
                                                   for key in ("fig7", "fig8", "fig16", "fig17"))]
    return "\n".join(lines) + "\n"


def fig7_figure(result: dict, path: Path) -> Path:
    """Four panels: loss against elapsed time per expert (Fig. 7) and against aggregate time (Fig. 8),
    both on log axes; loss against k (Fig. 16); averaging gain against error correlation (Fig. 17)."""
    fig, axes = subplots(2, 2, figsize=(11.0, 8.0))
    for index, (label, runs) in enumerate(result["curves"].items()):
        for seed, curve in enumerate(runs):
            for axis, basis in ((axes[0][0], "per_expert"), (axes[0][1], "aggregate")):
                axis.plot(curve[f"{basis}_seconds"], curve["loss"], "-o", markersize=3, color=f"C{index % 10}",
                          alpha=0.9 if seed == 0 else 0.5, label=f"N = {label}" if seed == 0 else None)
    axes[0][0].axvline(result["cutoff_seconds"], color="black", linestyle=":", linewidth=0.8)
    for axis, what in ((axes[0][0], "elapsed update time per expert, U·t̄ₑ (s, one thread; one device per expert)"),
                       (axes[0][1], "aggregate update time, U·Σₑ t̄ₑ (s, one thread)")):
        axis.set_xscale("log")
        axis.set_xlabel(what, fontsize=8)
        axis.set_ylabel("ensemble-validation loss (nats/byte)")
        axis.legend(fontsize=7)
    axes[0][0].set_title("Fig. 7 (left): fixed-width experts, elapsed", fontsize=9)
    axes[0][1].set_title("Fig. 8: the same runs, aggregate", fontsize=9)
    for seed, topk in zip(result["seeds"], result["topk"], strict=False):
        axes[1][0].plot(topk["k"], topk["loss_by_k"], "-o", markersize=3, label=f"seed {seed}")
    axes[1][0].axvline(result["top_k"], color="black", linestyle="--", linewidth=0.8)
    axes[1][0].set_xlabel("k (experts averaged per window)")
    axes[1][0].set_ylabel("ensemble-validation loss (nats/byte)")
    axes[1][0].set_title(f"Fig. 16: top-k, N = {result['largest']}", fontsize=9)
    for seed, analysis in zip(result["seeds"], result["error_correlation"], strict=False):
        axes[1][1].scatter([p["correlation"] for p in analysis["pairs"]], [p["gain"] for p in analysis["pairs"]], s=10,
                           label=f"seed {seed} (r = {analysis['gain_correlation_pearson']:+.2f})")
    axes[1][1].set_xlabel("residual error correlation of a pair")
    axes[1][1].set_ylabel("gain of averaging the pair (nats/byte)")
    axes[1][1].set_title(f"Fig. 17: pairs of N = {result['largest']}'s experts", fontsize=9)
    for axis in axes[1]:
        axis.legend(fontsize=7)
    fig.suptitle(f"{result['experiment']} at {result['scale']} scale, seeds {', '.join(map(str, result['seeds']))}",
                 fontsize=10)
    return save_figure(fig, path)


SETTING = re.compile(r"p(?P<n_pert>\d+)_b(?P<batch>\d+)$")
"""A settings run's label: `p<n_pert>_b<B>`."""
def _series(labels: list[str]) -> dict[str, list[str]]:
    """The n_pert series (at the smallest B) and the B series (at the smallest n_pert), each in order."""
    parsed = {label: (int(m["n_pert"]), int(m["batch"])) for label in labels if (m := SETTING.match(label))}
    if not parsed:
        return {}
    base_pert, base_batch = min(p for p, _ in parsed.values()), min(b for _, b in parsed.values())
    return {"n_pert": sorted((x for x, (_, b) in parsed.items() if b == base_batch), key=lambda x: parsed[x][0]),
            "B": sorted((x for x, (p, _) in parsed.items() if p == base_pert), key=lambda x: parsed[x][1])}


def settings_checks(name: str, order: list[str], curves: dict[str, list[dict]],
                    claims: dict[str, Claim]) -> list[dict]:
    """Each setting against the next smaller one, difference = smaller − larger: at equal updates (the
    last validation), and at equal elapsed time per expert, where the cheaper run ends (the pair's
    shorter final time, with the costlier run interpolated on its curve there)."""
    checks = []
    for smaller, larger in zip(order, order[1:], strict=False):
        final, document = compare_at(curves[smaller], curves[larger], "updates")
        checks.append(claims["updates"].check(final, document, name=name, larger=larger, smaller=smaller,
                                              updates=curves[larger][0]["updates"][-1]))
        cutoff = min(c["per_expert_seconds"][-1] for label in (smaller, larger) for c in curves[label])
        timed, document = compare_at(curves[smaller], curves[larger], "per_expert", cutoff)
        checks.append(claims["elapsed"].check(timed, document, name=name, larger=larger, smaller=smaller,
                                              cutoff=cutoff))
    return checks


def fig7_settings_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Fig. 7 (centre, right) beside the paper's claim: each series of settings at equal updates
    and at equal elapsed time per expert."""
    t7 = report["table7"]
    per_seed = t7["per_seed"]
    labels = [str(label) for label in t7["column_labels"]]
    curves = {label: [run_curve(Path(folders[entry["trial"][label]][entry["seed"]])) for entry in per_seed]
              for label in labels}
    series = _series(labels)
    checks = [check for name, order in series.items()
              for check in settings_checks(name, order, curves, experiment.claims)]
    rows = []
    for label, runs in curves.items():
        n_pert, batch = (int(v) for v in SETTING.match(label).groups())
        rows.append({"setting": label, "n_pert": n_pert, "B": batch, "directions": n_pert * batch,
                     "multiply_adds_per_update": runs[0]["multiply_adds_per_update"],
                     "updates": runs[0]["updates"][-1], "final": mean_sd([c["loss"][-1] for c in runs]),
                     "per_expert_seconds": mean_sd([c["per_expert_seconds"][-1] for c in runs])})
    return {"rows": rows, "series": series, "curves": curves, "checks": checks,
            "seeds": [e["seed"] for e in per_seed]}


def fig7_settings_markdown(result: dict) -> str:
    """One row per setting; then the claims, at equal updates and at equal elapsed time."""
    paper = result["paper_summary"]
    lines = [f"Ensemble-validation loss (nats/byte), mean ± sd over seeds {', '.join(map(str, result['seeds']))}. "
             f"Directions per update: n_pert × B (each window of a batch has its own n_pert directions). The paper "
             f"(N = {paper['experts']}): n_pert {', '.join(map(str, paper['n_pert']))} at B = 64 and B "
             f"{', '.join(map(str, paper['B']))} at n_pert = 64; its curves give no table of numbers.", "",
             *table_head(["setting", "n_pert", "B", "directions per update", "multiply-adds per update", "updates",
                          "final loss", "s per expert (final)"])]
    for row in result["rows"]:
        lines.append(table_row([row["setting"], str(row["n_pert"]), str(row["B"]), str(row["directions"]),
                                f"{row['multiply_adds_per_update']:.3g}", str(row["updates"]),
                                f"{number(row['final']['mean'])} ± {number(row['final']['sd'])}",
                                f"{row['per_expert_seconds']['mean']:.0f}"]))
    lines += ["", "The paper's statement:", "", f"- {paper['claim']}"]
    return "\n".join(lines) + "\n"


def fig7_settings_figure(result: dict, path: Path) -> Path:
    """Two panels, loss against elapsed time per expert on a log axis: the n_pert series and the B series."""
    fig, axes = subplots(1, 2, figsize=(11.0, 4.2), sharey=True)
    for axis, (name, order) in zip(axes, result["series"].items(), strict=False):
        for index, label in enumerate(order):
            for seed, curve in enumerate(result["curves"][label]):
                axis.plot(curve["per_expert_seconds"], curve["loss"], "-o", markersize=3, color=f"C{index}",
                          alpha=0.9 if seed == 0 else 0.5, label=label if seed == 0 else None)
        axis.set_xscale("log")
        axis.set_xlabel("elapsed update time per expert, U·t̄ₑ (s, one thread; one device per expert)", fontsize=8)
        axis.set_title(f"Fig. 7 ({'centre' if name == 'n_pert' else 'right'}): {name}", fontsize=9)
        axis.legend(fontsize=7)
    axes[0].set_ylabel("ensemble-validation loss (nats/byte)")
    return save_figure(fig, path)
