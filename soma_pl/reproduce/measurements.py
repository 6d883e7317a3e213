"""Experiments of measurements at fixed weights (`commands` in their file), read from the JSON their
commands wrote into the result's folder: Table 2 (`analyze params`), Figs. 10 and 11 and Fig. 5
with Table 8 (`analyze variance`), Table 12 and Fig. 6 (`bench inference`; Fig. 6 beside Fig. 14's
losses)."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

from soma_pl.errors import SomaError
from soma_pl.reproduce.experiments import Experiment, load_experiment
from soma_pl.reproduce.inference import label_experts
from soma_pl.reproduce.tables import save_figure, subplots, table_head, table_row

MARGIN = 0.1
"""How near a measured ratio must lie to its prediction (relative) for Figs. 10 and 11's predictions to hold."""


def _read(folder: Path, name: str) -> dict:
    """A command's JSON output; a missing or unreadable one is one clear error naming it."""
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError) as error:
        raise SomaError(f"{folder / name}: cannot read the command's output "
                        f"({type(error).__name__}: {error})") from error


def table2_result(folder: Path, experiment: Experiment) -> dict:
    """Table 2: each configuration's parameters counted from the real modules, beside the paper's."""
    claims, paper = experiment.claims, experiment.paper["rows"]
    rows = [{**row, "paper": paper[str(row["N"])]} for row in _read(folder, "params.json")["rows"]]
    checks = [claims["head"].check_count(rows[0]["head_params_per_expert"], rows[0]["paper"]["head"])]
    for row in rows:
        fields = {"experts": row["N"], "width": row["d_t"]}
        checks += [claims["ensemble"].check_count(row["ensemble_params"], row["paper"]["ensemble"], **fields),
                   claims["body"].check_count(row["expert_body_params"], row["paper"]["body"], **fields)]
    return {"rows": rows, "checks": checks}


def table2_markdown(result: dict) -> str:
    lines = [*table_head(["N", "d_t", "head per expert", "ensemble parameters (paper)",
                                            "expert body parameters (paper)"])]
    for row in result["rows"]:
        paper = row["paper"]
        head = f"{row['head_params_per_expert']:,}{' (shared)' if row['head_shared'] else ''}"
        lines.append(table_row([str(row["N"]), str(row["d_t"]), head,
                                f"{row['ensemble_params']:,} ({_short(paper['ensemble'])})",
                                f"{row['expert_body_params']:,} ({_short(paper['body'])})"]))
    return "\n".join(lines) + "\n"


def _short(count: float) -> str:
    """A count as the paper writes it: 8.33M, 32.9k."""
    return f"{count / 1e6:.3g}M" if count >= 1e6 else f"{count / 1e3:.3g}k"


def _ratio(upper: dict, lower: dict) -> tuple[float, float, float | None]:
    """(measured upper/lower, its standard error by the delta method, predicted where both points have
    a prediction). The points are separate measurements; their direction draws share keys (seed,
    draw, expert 0), a small correlation the standard error ignores."""
    ratio = upper["relative_error"] / lower["relative_error"]
    spread = ((upper["stderr"] / upper["relative_error"]) ** 2 + (lower["stderr"] / lower["relative_error"]) ** 2)
    predicted = upper["predicted"] / lower["predicted"] if "predicted" in upper and "predicted" in lower else None
    return ratio, ratio * spread ** 0.5, predicted


def fig10_result(folder: Path, experiment: Experiment) -> dict:
    """Figs. 10 and 11: relative gradient error at fixed weights against the number of experts at
    equal total size and against n_pert (sparse probes, Fig. 10), and separate against summed losses
    (dense probes, Fig. 11), each beside its prediction."""
    sparse, dense, claims = _read(folder, "sparse.json"), _read(folder, "dense.json"), experiment.claims
    points = sorted(sparse["experts"]["points"], key=lambda point: point["num_experts"])
    ratio, stderr, predicted = _ratio(points[0], points[-1])
    draws, doubling, joint = sparse["settings"]["repeats"], sparse["n_pert"]["doubling"][-1], \
        dense["n_pert"]["joint_vs_separate"]
    measured = {
        "shards": (ratio, stderr, predicted, draws,
                   {"smaller": points[0]["num_experts"], "larger": points[-1]["num_experts"]}),
        "perturbations": (doubling["ratio"], doubling["stderr"], doubling["predicted"], draws,
                          {"n_pert": doubling["n_pert"]}),
        "separate": (joint["ratio"], joint["stderr"], joint["predicted"], dense["settings"]["repeats"],
                     {"experts": joint["loss_grouping"], "n_pert": joint["n_pert"]})}
    checks = []
    for key, (value, error, prediction, count, fields) in measured.items():
        shown = {**fields, "measured": value, "predicted": prediction}
        checks += [claims[key].check_estimate(value, error, 1.0, count, **shown),
                   claims["predicted"].check_agrees(value, error, prediction, count, MARGIN, what=key, **shown)]
    best = [{"loss_grouping": curve["loss_grouping"],
             "measured": min(curve["points"], key=lambda p: p["relative_error"])["batch"],
             "predicted": min(curve["points"], key=lambda p: p["predicted"])["batch"]}
            for curve in dense["batch"]["curves"]]
    return {"weights": sparse["weights"], "experts_points": points, "shards_ratio": [ratio, stderr, predicted],
            "sparse_curves": sparse["n_pert"]["curves"], "dense_curves": dense["n_pert"]["curves"],
            "batch": dense["batch"], "best_batch": best, "settings": {"sparse": sparse["settings"],
                                                                      "dense": dense["settings"]},
            "checks": checks}


def _measured(point: dict) -> str:
    return f"{point['relative_error']:.4g} ± {point['stderr']:.2g} ({point['predicted']:.4g})"


def fig10_markdown(result: dict) -> str:
    paper, settings = result["paper_summary"], result["settings"]
    lines = [f"Weights: {result['weights']}; measured relative error ± its standard error over "
             f"the draws, predicted in brackets (App. G.1, no fitting). Paper: {paper['note']}", "",
             "**Fig. 10, left** (sparse probes, random init at equal total size, the largest n_pert):", "",
             *table_head(["N", "width", "parameters per expert", "relative error (predicted)"])]
    lines += [table_row([str(p["num_experts"]), str(p["width"]), f"{p['params_per_expert']:,}", _measured(p)])
              for p in result["experts_points"]]
    ratio, stderr, predicted = result["shards_ratio"]
    smaller, larger = (result["experts_points"][i]["num_experts"] for i in (0, -1))
    lines += ["", f"N = {smaller} over N = {larger}: "
              f"{ratio:.3g} ± {stderr:.2g} (predicted {predicted:.3g}; the paper's N = 1 over N = 256 at 8.44M: "
              f"{paper['shards_ratio']}×)."]
    for title, curves in (("**Fig. 10, right** (sparse probes, the checkpoint)", result["sparse_curves"]),
                          ("**Fig. 11, left** (dense probes, the checkpoint)", result["dense_curves"])):
        n_perts = [p["n_pert"] for p in curves[0]["points"]]
        lines += ["", f"{title}: relative error by n_pert and experts per loss", "",
                  *table_head(["experts per loss", *(f"n_pert = {n}" for n in n_perts)])]
        lines += [table_row([str(c["loss_grouping"]), *(_measured(p) for p in c["points"])]) for c in curves]
    batch = result["batch"]
    lines += ["", f"**Fig. 11, right** (dense probes, {batch['probe_coordinates']} coordinates per expert, a pool of "
              f"{batch['pool_windows']} windows, n_pert·B = {batch['budget']}, ν = {batch['nu']:.3g}; paper ν = "
              f"{paper['nu']}): the best B measured (predicted) by experts per loss: " + ", ".join(
                  f"{b['loss_grouping']}: {b['measured']} ({b['predicted']})" for b in result["best_batch"])
              + f"; the paper's {paper['best_batch']}.",
              "", f"Draws: {settings['sparse']['repeats']} per point (sparse), {settings['dense']['repeats']} "
              f"(dense), {settings['dense']['batch_repeats']} in the batch panel; context "
              f"{settings['sparse']['context']} "
              "bytes."]
    return "\n".join(lines) + "\n"


def fig10_figure(result: dict, path: Path) -> Path:
    """Relative error against N at equal size and against n_pert, measured (points) and predicted (lines)."""
    fig, (left, right) = subplots(1, 2, figsize=(9, 3.6))
    points = result["experts_points"]
    x = [p["num_experts"] for p in points]
    left.errorbar(x, [p["relative_error"] for p in points], yerr=[1.96 * p["stderr"] for p in points], fmt="o",
                  label="measured (95%)")
    left.plot(x, [p["predicted"] for p in points], "--", label="predicted")
    left.set(xscale="log", yscale="log", xlabel="experts N at equal total size", ylabel="relative error",
             title="Fig. 10, left (sparse probes)")
    for curve in result["sparse_curves"]:
        n = [p["n_pert"] for p in curve["points"]]
        bar = right.errorbar(n, [p["relative_error"] for p in curve["points"]],
                             yerr=[1.96 * p["stderr"] for p in curve["points"]], fmt="o",
                             label=f"{curve['loss_grouping']} per loss")
        right.plot(n, [p["predicted"] for p in curve["points"]], "--", color=bar[0].get_color())
    right.set(xscale="log", yscale="log", xlabel="n_pert", title="Fig. 10, right (sparse probes)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return save_figure(fig, path)



def table12_result(folder: Path, experiment: Experiment) -> dict:
    """Table 12: warm inference throughput of the equal-size ensembles, routing included, and the
    largest ensemble's throughput over each smaller one's, round by round (each round times every
    configuration in a fresh process, one after another)."""
    bench = _read(folder, "inference.json")
    rows = [{**row, "paper": experiment.paper["rows"].get(str(row["experts"]))} for row in bench["results"]]
    if any(row["paper"] is None for row in rows):
        raise SomaError(f"{folder / 'inference.json'}: configurations {[row['experts'] for row in rows]}; the paper's "
                        f"Table 12 has N = {', '.join(experiment.paper['rows'])}")
    largest, claim = max(rows, key=lambda row: row["experts"]), experiment.claims["faster"]
    checks = []
    for rival in sorted((row for row in rows if row is not largest), key=lambda row: -row["experts"]):
        mean, stderr, rounds = _round_ratios(largest["tokens_per_s_per_round"], rival["tokens_per_s_per_round"])
        paper = largest["paper"]["tokens_per_s"] / rival["paper"]["tokens_per_s"]
        checks.append(claim.check_estimate(mean, stderr, 1.0, rounds, "timing rounds", larger=largest["experts"],
                                           smaller=rival["experts"], k=rival["top_k"], paper=paper))
    return {"rows": rows, "machine": bench["machine"], "load_average_after": bench["load_average_after"],
            "settings": bench["settings"], "checks": checks}


def table12_markdown(result: dict) -> str:
    settings = result["settings"]
    lines = [f"Median of {settings['repeats']} warm batches in each of {settings['rounds']} rounds "
             f"(a fresh process per configuration per round), {settings['threads'] or 'all'} thread(s); a request is "
             "1,024 bytes scoring the last 768. Paper (one GPU) in brackets.", "",
             *table_head(["model", "parameters", "top-k", "batch", "tokens/s (paper)", "per round", "latency ms",
                          "routing share (paper)", "peak above baseline"])]
    for row in result["rows"]:
        paper = row["paper"] or {}
        lines.append(table_row([row["model"], f"{row['parameters']:,}", str(row["top_k"]), str(row["batch_size"]),
                                f"{row['tokens_per_s']:,.0f} ({paper.get('tokens_per_s', 0):,.0f})",
                                ", ".join(f"{t:,.0f}" for t in row["tokens_per_s_per_round"]),
                                f"{row['latency_ms']:,.0f}",
                                f"{row['routing_share']:.2%} ({paper.get('routing_share', '—')})",
                                f"{row['peak_above_baseline_bytes'] / 2 ** 20:,.0f} MiB"]))
    return "\n".join(lines) + "\n"


def _round_ratios(upper: list[float], lower: list[float]) -> tuple[float, float, int]:
    """(mean, standard error, rounds) of `upper / lower` taken round by round (each round timed both in
    fresh processes, one after the other)."""
    ratios = [a / b for a, b in zip(upper, lower, strict=True)]
    stderr = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("inf")
    return statistics.fmean(ratios), stderr, len(ratios)


def partner_result(folder: Path, experiment: Experiment) -> tuple[Path, dict]:
    """The saved result an experiment is paired with (`losses`), at the same scale as `folder`; a
    missing one is one line naming the command that makes it."""
    name = experiment.losses + folder.name.removeprefix(experiment.name)  # `fig14`, or `fig14_paper`
    path = folder.parent / name / "result.json"
    try:
        return path, json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SomaError(f"{experiment.name} pairs its measurement with {path}, which cannot be read "
                        f"({type(error).__name__}); run `python -m soma_pl.cli reproduce {experiment.losses}` "
                        "first") from error


def fig6_result(folder: Path, experiment: Experiment) -> dict:
    """Fig. 6 (right): each ensemble's warm inference throughput (this experiment's `bench inference`)
    beside the lowest ensemble-validation loss of each of its runs at the common budget (the saved
    result of the experiment named by `losses`, matched by N, size and top-k); the smaller N's
    throughput over the larger's, round by round, for each pair Table 12 gives the paper's of."""
    path, partner = partner_result(folder, experiment)
    runs = {label_experts(row["run"]): row for row in partner["rows"]}
    common = {(n, row["parameters"], row["top_k"]): row["run"] for (n, long), row in runs.items() if not long}
    paper = {int(n): row["tokens_per_s"] for n, row in load_experiment(experiment.paper["throughputs"]).paper[
        "rows"].items()}
    bench, rows = _read(folder, "inference.json"), []
    for row in bench["results"]:
        run = common.get((row["experts"], row["parameters"], row["top_k"]))
        if run is None or not partner["curves"].get(run):
            raise SomaError(f"{folder / 'inference.json'}: N = {row['experts']} of {row['parameters']:,} parameters, "
                            f"top-{row['top_k']}, has no run of that shape with a curve in {path} "
                            f"(runs: {sorted(common.values())})")
        seeds = partner["curves"][run]
        rows.append({**row, "run": run, "lowest_loss": [min(seed["loss"]) for seed in seeds],
                     "validations": len(seeds[0]["loss"]), "paper": paper.get(row["experts"])})
    by_n, claim, checks = {row["experts"]: row for row in rows}, experiment.claims["slower"], []
    paired = sorted(n for n in by_n if by_n[n]["paper"])
    for smaller, larger in zip(paired, paired[1:], strict=False):
        mean, stderr, rounds = _round_ratios(by_n[smaller]["tokens_per_s_per_round"],
                                             by_n[larger]["tokens_per_s_per_round"])
        checks.append(claim.check_estimate(mean, stderr, 1.0, rounds, "timing rounds", smaller=smaller,
                                           larger=larger, k=by_n[larger]["top_k"],
                                           paper=by_n[smaller]["paper"] / by_n[larger]["paper"]))
    return {"rows": rows, "losses_from": {"experiment": experiment.losses, "result": str(path),
                                          "sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
            "machine": bench["machine"], "load_average_after": bench["load_average_after"],
            "settings": bench["settings"], "checks": checks}


def fig6_markdown(result: dict) -> str:
    settings = result["settings"]
    threads = settings["threads"] or "all"
    lines = [f"Throughput: median of {settings['repeats']} warm batches in each of "
             f"{settings['rounds']} rounds (a fresh process per configuration per round), {threads} thread(s). "
             f"Loss: the lowest ensemble-validation loss of each run of `{result['losses_from']['experiment']}`, "
             "per seed, over its validations (more for a run that makes more updates in the budget). Paper (one "
             "GPU, 8.44M) in brackets.", "",
             *table_head(["model", "parameters", "top-k", "tokens/s (paper)", "per round", "validations",
                          "lowest loss per seed", "mean"])]
    for row in result["rows"]:
        paper = f"{row['paper']:,.0f}" if row["paper"] else "—"
        lines.append(table_row([row["model"], f"{row['parameters']:,}", str(row["top_k"]),
                                f"{row['tokens_per_s']:,.0f} ({paper})",
                                ", ".join(f"{t:,.0f}" for t in row["tokens_per_s_per_round"]),
                                str(row["validations"]), ", ".join(f"{loss:.4f}" for loss in row["lowest_loss"]),
                                f"{statistics.fmean(row['lowest_loss']):.4f}"]))
    return "\n".join(lines) + "\n"


def fig6_figure(result: dict, path: Path) -> Path:
    """Lowest loss (mean over seeds, the seeds' range as bars) against tokens/s, one point per N."""
    fig, axis = subplots(figsize=(5, 3.6))
    for row in result["rows"]:
        mean, losses = statistics.fmean(row["lowest_loss"]), row["lowest_loss"]
        axis.errorbar([row["tokens_per_s"]], [mean], yerr=[[mean - min(losses)], [max(losses) - mean]], fmt="o")
        axis.annotate(f"N = {row['experts']}", (row["tokens_per_s"], mean), textcoords="offset points", xytext=(5, 5))
    axis.set(xscale="log", xlabel="inference tokens/s (routing included)", ylabel="lowest ensemble validation loss",
             title="Fig. 6, right (equal total size)")
    return save_figure(fig, path)


def fig5_result(folder: Path, experiment: Experiment) -> dict:
    """Fig. 5 and Table 8: the total error R of each (N, n_pert, B) against its BPTT reference, with
    its step's multiply-adds and measured seconds; the largest N at the base against the N = 1 model
    at the largest n_pert and at the largest B, and each N = 1 curve's end against its start."""
    output, claims = _read(folder, "reference.json"), experiment.claims
    panel, draws = output["reference"], output["settings"]["repeats"]
    base, scale = panel["base"], max(panel["scales"])
    points = {(p["experts"], p["n_pert"], p["batch"]): p for p in panel["points"]}
    largest = max(p["experts"] for p in panel["points"])
    sharded, start = points[(largest, base["n_pert"], base["batch"])], points[(1, base["n_pert"], base["batch"])]
    ends = {"n_pert": points[(1, base["n_pert"] * scale, base["batch"])],
            "batch": points[(1, base["n_pert"], base["batch"] * scale)]}
    checks = []
    for name, end in ends.items():
        ratio, stderr, _ = _ratio(end, sharded)
        checks.append(claims["shards"].check_estimate(ratio, stderr, 1.0, draws, larger=largest, scale=scale,
                                                      what=name, measured=ratio,
                                                      cost=sharded["multiply_adds"] / end["multiply_adds"]))
    for name, end in ends.items():
        ratio, stderr, _ = _ratio(start, end)
        checks.append(claims[name].check_estimate(ratio, stderr, 1.0, draws, scale=scale, measured=1 - 1 / ratio))
    return {"points": panel["points"], "table8": panel["table8"], "base": base, "scales": panel["scales"],
            "context": panel["context"], "reference_windows": panel["reference_windows"], "pool": panel["pool"],
            "draws": draws, "checks": checks}


def fig5_markdown(result: dict) -> str:
    paper = result["paper_summary"]
    lines = [f"R = Σₑ E‖ĝₑ − g_ref,e‖² / Σₑ ‖g_ref,e‖² (Eq. 5) over {result['draws']} draws of a "
             "batch and of directions, ± its standard error; each expert's reference is the autograd gradient on "
             f"{result['reference_windows']} windows of {result['context'] + 1} bytes, its batches drawn from a pool "
             f"of {result['pool']} others. A step's cost: multiply-adds of its 2·n_pert·B·T byte forwards over all "
             "experts, and its measured seconds (one thread, the median over draws; read them with the load average "
             f"below). Paper: {paper['note']}", "",
             *table_head(["N", "width", "n_pert", "B", "R", "R, independent reference", "multiply-adds per step",
                          "seconds per step"])]
    for p in sorted(result["points"], key=lambda p: (p["experts"], p["n_pert"], p["batch"])):
        lines.append(table_row([str(p["experts"]), str(p["width"]), str(p["n_pert"]), str(p["batch"]),
                                f"{p['relative_error']:.4g} ± {p['stderr']:.2g}",
                                f"{p['relative_error_independent_reference']:.4g}", f"{p['multiply_adds']:.3g}",
                                f"{p['seconds']:.3g}"]))
    moved = max(abs(p["relative_error_independent_reference"] / p["relative_error"] - 1) for p in result["points"])
    lines += ["", "**Table 8**: each reference's cosine distance to the gradient on an independent batch of the same "
              f"size; the independent reference moves R by up to {moved:.0%} (paper: {paper['table8']}).", "",
              *table_head(["N", "reference windows", "cosine distance"])]
    lines += [table_row([str(r["experts"]), str(r["reference_windows"]), f"{r['cosine_distance']:.4f}"])
              for r in result["table8"]]
    return "\n".join(lines) + "\n"


def fig5_figure(result: dict, path: Path) -> Path:
    """R against multiply-adds per global step: the N curve at the base, the n_pert and B curves at N = 1."""
    base, points = result["base"], result["points"]
    curves = {"N (base n_pert, B)": [p for p in points if (p["n_pert"], p["batch"]) == (base["n_pert"], base["batch"])],
              "n_pert (N = 1)": [p for p in points if p["experts"] == 1 and p["batch"] == base["batch"]],
              "B (N = 1)": [p for p in points if p["experts"] == 1 and p["n_pert"] == base["n_pert"]]}
    fig, axis = subplots(figsize=(6.5, 4.2))
    for label, curve in curves.items():
        curve = sorted(curve, key=lambda p: p["multiply_adds"])
        axis.errorbar([p["multiply_adds"] for p in curve], [p["relative_error"] for p in curve],
                      yerr=[1.96 * p["stderr"] for p in curve], fmt="-o", markersize=4, capsize=3, label=label)
    axis.set(xscale="log", yscale="log", xlabel="multiply-adds per global step",
             ylabel="relative error R against the reference", title="Fig. 5 (CPU scale): total gradient error")
    axis.legend(fontsize=7)
    return save_figure(fig, path)
