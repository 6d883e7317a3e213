"""Table 4: the methods at one equal budget of measured update time, test loss at the end.

Each row is a sweep column (`soma_n2`, `spsa_<n_pert>`, `eggroll`, `ddpp`) run once per seed until
its budget of aggregate update time (Table 3's U·Σₑ t̄ₑ, every expert and rank counted) is spent;
its trial's own test of the last checkpoint gives the test loss and the per-window losses that
pair it with SOMA's on the same windows. The claim, SOMA N = 2 has the lowest test loss, is checked
against each other row.
"""

from __future__ import annotations

import json
from pathlib import Path

from soma_pl.eval.bootstrap import paired_document_interval
from soma_pl.io import write_json_atomic
from soma_pl.reproduce.ablations import run_test_scores
from soma_pl.reproduce.tables import checks_table, interval_text, number, rows_figure, run_footer, table_head, table_row
from soma_pl.reproduce.verdicts import decide, mean_sd

SOMA = "soma_n2"
"""The row the claim is about."""
TABLE4_PAPER = {
    "soma_n2": {"configuration": "SOMA N = 2", "n_pert": 64, "updates": "65.0k", "gpu_hours": 150, "test": 1.76},
    "spsa_32": {"configuration": "Monolithic SPSA", "n_pert": 64, "updates": "30.0k", "gpu_hours": 152, "test": 2.00},
    "spsa_128": {"configuration": "Monolithic SPSA", "n_pert": 256, "updates": "1.32k", "gpu_hours": 150,
                 "test": 2.11},
    "spsa_512": {"configuration": "Monolithic SPSA", "n_pert": 1024, "updates": "839", "gpu_hours": 148,
                 "test": 2.00},
    "eggroll": {"configuration": "Monolithic EGGROLL", "n_pert": None, "updates": "7.40k", "gpu_hours": 141,
                "test": 2.21},
}
"""The paper's Table 4 rows beside ours (its n_pert 64, 256, 1024 are the demo's 32, 128, 512)."""
EXTERNAL_TEXT = "data/external/moby_dick"
"""The external text of Table 9 at CPU scale (`python -m soma_pl.cli external-text`)."""
TABLE9_PAPER = {"soma_n2": {"validation": 2.047, "test": 2.066}, "spsa_32": {"validation": 2.240, "test": 2.254},
                "spsa_128": {"validation": 2.348, "test": 2.363}, "spsa_512": {"validation": 2.271, "test": 2.290},
                "text": "WikiText-103 validation and test, 8.44M parameters near 150 aggregate GPU-hours"}
"""The paper's Table 9 (its n_pert 64, 256, 1024 are the demo's 32, 128, 512)."""
NAMES = {"soma_n2": "SOMA N = 2", "spsa_32": "Monolithic SPSA", "spsa_128": "Monolithic SPSA",
         "spsa_512": "Monolithic SPSA", "eggroll": "Monolithic EGGROLL", "ddpp": "DDPP (2 processes)",
         "spsa_64": "Monolithic SPSA", "spsa_256": "Monolithic SPSA", "spsa_1024": "Monolithic SPSA"}
PAPER_ROW = {"spsa_64": "spsa_32", "spsa_256": "spsa_128", "spsa_1024": "spsa_512"}
"""A paper-scale row (sweeps/table4.yaml names the paper's n_pert) → the key of the paper's numbers."""


def _compute(run_dir: Path) -> dict:
    """The run's updates and aggregate update seconds (its `compute.json`)."""
    report = json.loads((run_dir / "compute.json").read_text())
    return {"updates": report["updates"], "seconds": report["aggregate_device_hours"] * 3600,
            "physical_seconds": report["physical_device_hours"] * 3600}


def table4_result(report: dict, folders: dict[int, dict[int, str]]) -> dict:
    """Table 4 beside the paper: per row, each seed's test loss (with its 95% document interval),
    updates and measured compute; one check per other row that SOMA N = 2's test loss is lower."""
    t7 = report["table7"]
    labels = [str(label) for label in t7["column_labels"]]
    per_seed = t7["per_seed"]
    recorded = report.get("test_score_files", {})
    scores, compute = {}, {}
    for label in labels:
        runs = [(folders[entry["trial"][label]][entry["seed"]], recorded.get(entry["trial"][label], {})
                 .get(entry["seed"])) for entry in per_seed]
        scores[label] = [run_test_scores(run, record) for run, record in runs]
        compute[label] = [_compute(Path(run)) for run, _ in runs]
    rows = []
    for label in labels:
        rows.append({"row": label, "configuration": NAMES.get(label, label),
                     "test": mean_sd([s["loss"] for s in scores[label]]),
                     "test_95": [s["bootstrap_95"] for s in scores[label]],
                     "updates": mean_sd([c["updates"] for c in compute[label]]),
                     "seconds": mean_sd([c["seconds"] for c in compute[label]]),
                     "physical_seconds": mean_sd([c["physical_seconds"] for c in compute[label]]),
                     "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[label], strict=True)},
                     "paper": TABLE4_PAPER.get(PAPER_ROW.get(label, label))})
    checks = []
    for label in labels:
        if label == SOMA or SOMA not in scores:
            continue
        differences = [a["loss"] - b["loss"] for a, b in zip(scores[label], scores[SOMA], strict=True)]
        check = decide(f"SOMA N = 2 reaches a lower test loss than {NAMES.get(label, label)} ({label})", differences,
                       paired_document_interval(scores[label], scores[SOMA]))
        checks.append({**check.as_dict(), "basis": "equal measured update time", "split": "test"})
    return {"rows": rows, "checks": checks, "seeds": [e["seed"] for e in per_seed], "paper_summary": TABLE4_PAPER,
            "trials": report["trials"], "failed": report["failed"]}


def table4_markdown(result: dict) -> str:
    """Table 4's layout: configuration, n_pert, updates, compute and test loss; the paper's beside."""
    lines = [f"# {result['experiment']} ({result['scale']} scale): {result['title']}", "",
             f"Equal compute: {result['basis']}.", "",
             f"Mean ± sd over seeds {', '.join(map(str, result['seeds']))}; each seed's 95% document interval "
             "follows. Updates are per expert for SOMA; seconds are Table 3's aggregate update time (every expert "
             "and rank counted) and the physical total (ranks × training wall time). Paper: Table 4 (~150 aggregate "
             "GPU-hours, 8.44M parameters).", "",
             *table_head(["Row", "Configuration", "Updates", "Update time (s)", "Physical (s)", "Test loss",
                          "95% documents, per seed", "Paper: n_pert", "updates", "GPU-hours", "test loss"])]
    for row in result["rows"]:
        paper = row["paper"] or {}
        lines.append(table_row([row["row"], row["configuration"], f"{row['updates']['mean']:.0f}",
                                f"{row['seconds']['mean']:.0f}", f"{row['physical_seconds']['mean']:.0f}",
                                f"{number(row['test']['mean'])} ± {number(row['test']['sd'])}",
                                " ".join(interval_text(i, False) for i in row["test_95"]),
                                str(paper.get("n_pert") or "—"), str(paper.get("updates", "—")),
                                str(paper.get("gpu_hours", "—")), number(paper.get("test"), 2)]))
    lines += ["", "## The paper's claims", "", *checks_table(result["checks"]), "",
              run_footer(result)]
    return "\n".join(lines) + "\n"


def table4_figure(result: dict, path: Path) -> Path:
    """Each row's test loss per seed and mean."""
    return rows_figure(result, path, "test", "test loss (nats/byte)",
                       f"{result['experiment']} at {result['scale']} scale: equal measured update time")


def external_scores(run_dir: Path, text: str = EXTERNAL_TEXT) -> dict:
    """The run's last checkpoint evaluated, frozen, on `text` (once: kept in `<run_dir>/external/`)."""
    from soma_pl.evaluate_text import evaluate

    saved = run_dir / "external" / f"{Path(text).name}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    checkpoint = json.loads((run_dir / "summary.json").read_text())["last_checkpoint"]
    scores = evaluate(checkpoint, text)
    write_json_atomic(saved, scores)
    return scores


def table9_result(report: dict, folders: dict[int, dict[int, str]], text: str = EXTERNAL_TEXT) -> dict:
    """Table 9 beside the paper: Table 4's last checkpoints (chosen by its protocol, before any
    external score exists) evaluated frozen on the external text; SOMA N = 2 against every other row."""
    t7 = report["table7"]
    labels = [str(label) for label in t7["column_labels"]]
    per_seed = t7["per_seed"]
    scores = {label: [external_scores(Path(folders[entry["trial"][label]][entry["seed"]]), text)
                      for entry in per_seed] for label in labels}
    first = next(iter(scores.values()))[0] if scores and per_seed else {}
    rows = [{"row": label, "configuration": NAMES.get(label, label),
             "external": mean_sd([s["loss"] for s in scores[label]]),
             "external_95": [s["bootstrap_95"] for s in scores[label]],
             "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[label], strict=True)},
             "paper": TABLE9_PAPER.get(PAPER_ROW.get(label, label))} for label in labels]
    checks = []
    for label in labels:
        if label == SOMA or SOMA not in scores:
            continue
        differences = [a["loss"] - b["loss"] for a, b in zip(scores[label], scores[SOMA], strict=True)]
        check = decide(f"SOMA N = 2 reaches a lower frozen loss on the external text than {NAMES.get(label, label)} "
                       f"({label})", differences, paired_document_interval(scores[label], scores[SOMA]))
        checks.append({**check.as_dict(), "basis": "Table 4's equal measured update time", "split": "external"})
    return {"rows": rows, "checks": checks, "seeds": [e["seed"] for e in per_seed], "paper_summary": TABLE9_PAPER,
            "text": {key: first.get(key) for key in ("text", "documents", "documents_scored", "windows", "bytes")},
            "trials": report["trials"], "failed": report["failed"]}


def table9_markdown(result: dict) -> str:
    """Table 9's layout: each checkpoint's frozen loss on the external text; the paper's beside."""
    text = result["text"]
    lines = [f"# {result['experiment']} ({result['scale']} scale): {result['title']}", "",
             f"Equal compute: {result['basis']}.", "",
             f"Frozen next-byte loss (nats/byte) on `{text['text']}` ({text['documents']} documents, "
             f"{text['windows']} windows of 1,025 bytes from {text['documents_scored']} of them), routed on 256 bytes "
             f"and scored on the next 768 as in Table 1; mean ± sd over seeds {', '.join(map(str, result['seeds']))} "
             "and each seed's 95% document interval. Paper: Table 9 (WikiText-103).", "",
             *table_head(["Row", "Configuration", "External text", "95% documents, per seed",
                          "Paper: validation", "Paper: test"])]
    for row in result["rows"]:
        paper = row["paper"] or {}
        lines.append(table_row([row["row"], row["configuration"],
                                f"{number(row['external']['mean'])} ± {number(row['external']['sd'])}",
                                " ".join(interval_text(i, False) for i in row["external_95"]),
                                number(paper.get("validation"), 3), number(paper.get("test"), 3)]))
    lines += ["", "## The paper's claims", "", *checks_table(result["checks"]), "",
              run_footer(result, "Table 4's trials reused; the evaluations are part of it")]
    return "\n".join(lines) + "\n"


def table9_figure(result: dict, path: Path) -> Path:
    """Each checkpoint's frozen external loss per seed and mean."""
    return rows_figure(result, path, "external", "frozen loss on the external text (nats/byte)",
                       f"{result['experiment']} at {result['scale']} scale: {Path(result['text']['text'] or '').name}")
