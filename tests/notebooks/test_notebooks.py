"""Every notebook, executed unmodified on tiny results made by the real commands, draws inline and
saves each of its figures as a PNG into `$SOMA_PL_FIGURES`; committed notebooks are stripped.

Notebooks run as Jupyter and `jupyter-execute` run them: in `notebooks/`, with relative
`$SOMA_PL_RESULTS` / `$SOMA_PL_FIGURES`, which start at the repository root; afterwards `notebooks/`
holds exactly what it held before (no figure, no cache, the notebook unmodified).

Each notebook family has a writer that puts its inputs into a fresh `$SOMA_PL_RESULTS` folder:
the real commands with tiny settings where that is cheap (`bench`, `analyze`, `sweep report`),
small files in the documented formats otherwise (run folders as the CSV logger writes them).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

from soma_pl.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
FAMILIES = ("scaling", "variance", "routing", "sweeps", "inference")
FIGURES = {"scaling": {"scaling_curves.png", "scaling_target.png", "scaling_budget_map.png"},
           "inference": {"inference_table12.png", "memory_context.png"},
           "variance": {"variance_fig10.png", "variance_fig11.png"},
           "routing": {"routing_topk.png", "routing_error_correlation.png"},
           "sweeps": {"sweeps_table6.png", "sweeps_table7.png"}}
"""The PNG files each notebook saves (all of its figures); notebooks/README.md lists the same."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_runs(results: Path) -> None:
    """Three run folders: compute.json, a logged compute column, and update times only."""
    runs = results / "runs"
    layouts = {"spsa_n1": (1, "compute.json", runs / "spsa_n1" / "version_0"),
               "soma_n2": (2, "column", runs / "soma_n2"),
               "soma_n8": (8, "update_seconds", runs / "soma_n8" / "version_1")}
    for _name, (experts, accounting, folder) in layouts.items():
        folder.mkdir(parents=True)
        columns = ["epoch", "step", "train/loss", "train/update_seconds", "val/loss"]
        columns += [f"expert/{e}/val_loss" for e in range(experts if experts > 1 else 0)]
        columns += ["compute/aggregate_device_hours"] if accounting == "column" else []
        rows = []
        for step in range(2, 41, 2):
            seconds = 0.5 * experts ** 0.5
            rows.append({"epoch": 0, "step": step, "train/loss": 5 - step / 20, "train/update_seconds": seconds,
                         **({"compute/aggregate_device_hours": step * seconds / 3600}
                            if accounting == "column" else {})})
            if step % 10 == 0:
                rows.append({"epoch": 0, "step": step, "val/loss": 5.5 - np.log1p(step) * (0.3 + 0.05 * experts),
                             **{f"expert/{e}/val_loss": 3.0 for e in range(experts if experts > 1 else 0)}})
        with open(folder / "metrics.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        (folder / "summary.json").write_text(json.dumps({"module": "ZOModule", "global_step": 40}))
        if accounting == "compute.json":
            (folder / "compute.json").write_text(json.dumps({"updates": 40, "aggregate_device_hours": 40 * 0.5 / 3600}))
        if accounting == "update_seconds":
            (folder / "hparams.yaml").write_text(f"num_experts: {experts}\nspsa:\n  n_pert: 64\n  micro_batch: 64\n")


def _write_bench(results: Path, monkeypatch) -> None:
    from soma_pl.bench import memory

    # in this process: tiny runs need no clean heap (bench inference and memory both spawn through memory)
    monkeypatch.setattr(memory, "in_fresh_process", lambda function, *args: function(*args))
    tiny = ["--settings.num_layers", "1", "--settings.embed_dim", "8", "--settings.threads", "null"]
    main(["bench", "inference", "--models", "[{experts: 1, width: 8, batch_size: 2}, "
          "{experts: 4, width: 4, batch_size: 2, shared_head: true}]", "--settings.repeats", "1", *tiny,
          "--out", str(results / "bench_inference.json")])
    main(["bench", "memory", "--contexts", "[8, 16]", "--settings.width", "8", "--settings.micro_batch", "2",
          *tiny, "--out", str(results / "bench_memory.json")])


def _write_sweep_report(results: Path) -> None:
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from soma_pl.sweeps.study import SWEEP_ATTR

    labels = {"N": [1, 2], "lr": [0.001, 0.002]}
    storage = f"sqlite:///{results / 'sweep.db'}"
    study = optuna.create_study(study_name="tiny", storage=storage)
    study.set_user_attr(SWEEP_ATTR, {"factors": ["N", "lr"], "ranges": [], "seeds": [1, 2], "columns": "N",
                                     "baseline": 1, "labels": labels, "sweep_file": "tiny.yaml"})
    distributions = {k: CategoricalDistribution(v) for k, v in labels.items()}
    for seed in (1, 2):
        for n in (1, 2):
            for lr in (0.001, 0.002):
                val, test = 2.3 - 0.01 * n + lr * seed, 2.25 - 0.02 * n + 0.001 * seed
                params = {"N": n, "lr": lr}  # the seed is a user attribute, not a parameter
                runs = [{"seed": seed, "val_loss": val, "test_loss": test, "global_step": 8, "run_dir": "x"}]
                study.add_trial(create_trial(params=params, distributions=distributions, value=val,
                                             user_attrs={"runs": runs, "test_loss": test, "seed": seed,
                                                         "point": json.dumps({**params, "seed": seed})}))
    main(["sweep", "report", "--study", "tiny", "--storage", storage, "--out", str(results / "sweep_report.json")])


def _write_variance(results: Path) -> None:
    main(["analyze", "variance", "--context", "4", "--batch", "1", "--experts", "2", "--width", "4",
          "--n_pert", "[2, 4]", "--loss_groupings", "[1, 2]", "--repeats", "2", "--expert_counts", "[1, 2]",
          "--total_params", "2048", "--pool", "4", "--probe_coordinates", "8", "--budget", "4",
          "--batch_sizes", "[1, 2]", "--batch_repeats", "2", "--out", str(results / "variance.json")])


def _write_routing(results: Path) -> None:
    """A 3-expert SOMA checkpoint with its router, six validation windows, then `analyze topk` and
    `analyze error-correlation` on them."""
    from soma_pl.data.formats.evalsets import EvalSet
    from soma_pl.lit import ModelShape, ZOModule
    from soma_pl.models.router import HashedNgramEncoder, Router
    from tests.analysis.conftest import write_manifest

    torch.manual_seed(0)
    shape = ModelShape(width=8, num_layers=1, embed_dim=8, time_chunk=256)
    module = ZOModule(num_experts=3, shape=shape, init="random", top_k=2)
    module.routing.router = Router(HashedNgramEncoder(dim=16), torch.randn(3, 16))
    checkpoint = {"state_dict": module.state_dict(),
                  "hyper_parameters": {**dict(module.hparams), "_class_path": "soma_pl.lit.ZOModule"}}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, results / "soma.ckpt")
    (results / "data").mkdir()
    windows = np.random.default_rng(0).integers(0, 256, (6, 1025), dtype=np.uint8)
    EvalSet(windows, np.array([f"d{i // 2}" for i in range(6)]), np.array(["s"] * 6),
            np.zeros(6, dtype=np.int64)).save(results / "data" / "ensemble_val.npz")
    write_manifest(results / "data")
    common = ["--checkpoint", str(results / "soma.ckpt"), "--data", str(results / "data")]
    main(["analyze", "topk", *common, "--out", str(results / "topk.json")])
    main(["analyze", "error-correlation", *common, "--bins", "2", "--out", str(results / "error_correlation.json")])


WRITERS: dict[str, Callable] = {
    "scaling": lambda results, monkeypatch: _write_runs(results),
    "inference": _write_bench,
    "sweeps": lambda results, monkeypatch: _write_sweep_report(results),
    "variance": lambda results, monkeypatch: _write_variance(results),
    "routing": lambda results, monkeypatch: _write_routing(results),
}


def _stems() -> list[str]:
    return sorted(set(FAMILIES) | {path.stem for path in NOTEBOOKS.glob("*.ipynb")})


def test_every_committed_notebook_has_stripped_outputs():
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert {"scaling", "inference"} <= {path.stem for path in notebooks}
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {index} has outputs"


def _contents(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder`, hidden ones included: a file's bytes, None for a folder."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _execute(path: Path, monkeypatch) -> nbformat.NotebookNode:
    """Run the notebook at `path` in memory as `jupyter-execute` does: its kernel in the notebook's
    folder, the inline backend; the file itself is only read."""
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own (inline) backend, as in Jupyter
    notebook = nbformat.read(path, as_version=4)
    cells = len(notebook.cells)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    assert len(notebook.cells) == cells
    return notebook


def _check_figures(stem: str, notebook: nbformat.NotebookNode, figures: Path) -> None:
    assert stem in FIGURES, f"notebooks/{stem}.ipynb: list the PNG files it saves in FIGURES"
    written = {p.name for p in figures.glob("*.png")}
    assert written == FIGURES[stem], f"{stem}: wrote {sorted(written)}, expected {sorted(FIGURES[stem])}"
    for name in written:
        data = (figures / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, f"{stem}: {name} is not a drawn PNG"
    inline = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert len(inline) >= len(FIGURES[stem]), f"{stem}: {len(inline)} figures shown inline, expected every one"


@pytest.mark.parametrize("stem", _stems())
def test_notebook_executes_headless_on_tiny_results(stem, tmp_path, monkeypatch):
    """In notebooks/ with folders given relative to the repository root (which, seen from
    notebooks/, point one level off): reads and draws there, and leaves notebooks/ as it was."""
    path = NOTEBOOKS / f"{stem}.ipynb"
    if not path.is_file():
        pytest.skip(f"notebooks/{stem}.ipynb does not exist yet (its family is being written)")
    assert stem in WRITERS, f"no tiny inputs for notebooks/{stem}.ipynb: add a writer to WRITERS"
    results, figures = tmp_path / "results", tmp_path / "figures"  # figures: made by the notebook
    results.mkdir()
    WRITERS[stem](results, monkeypatch)
    monkeypatch.setenv("SOMA_PL_RESULTS", os.path.relpath(results, ROOT))
    monkeypatch.setenv("SOMA_PL_FIGURES", os.path.relpath(figures, ROOT))
    before = _contents(NOTEBOOKS)
    notebook = _execute(path, monkeypatch)
    _check_figures(stem, notebook, figures)
    assert _contents(NOTEBOOKS) == before, f"{stem}: notebooks/ changed"


def test_default_folders_are_the_repository_roots_results_and_figures(tmp_path, monkeypatch):
    """Unset variables mean `<repository>/results` and `<repository>/figures`, wherever the kernel
    runs; a copy of the repository layout keeps the real one's folders out of it."""
    repository = tmp_path / "repository"
    (repository / "notebooks").mkdir(parents=True)
    (repository / "pyproject.toml").write_text("[project]\nname = 'soma_pl'\n")
    path = repository / "notebooks" / "sweeps.ipynb"
    shutil.copyfile(NOTEBOOKS / "sweeps.ipynb", path)
    (repository / "results").mkdir()
    WRITERS["sweeps"](repository / "results", monkeypatch)
    monkeypatch.delenv("SOMA_PL_RESULTS", raising=False)
    monkeypatch.delenv("SOMA_PL_FIGURES", raising=False)
    before = _contents(repository / "notebooks")
    notebook = _execute(path, monkeypatch)
    _check_figures("sweeps", notebook, repository / "figures")
    assert _contents(repository / "notebooks") == before == {"sweeps.ipynb": (NOTEBOOKS / "sweeps.ipynb").read_bytes()}
    printed = "".join(output.get("text", "") for output in notebook.cells[1].outputs)
    assert f"results: {repository / 'results'}" in printed and f"figures: {repository / 'figures'}" in printed
