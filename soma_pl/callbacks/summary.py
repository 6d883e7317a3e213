"""`RunSummary`: writes `summary.json` into the run directory when `fit` ends and prints where."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from soma_pl.callbacks.compute import ComputeAccounting, ComputeBudget, run_directory
from soma_pl.io import write_json_atomic


def _plain(value):
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _find(trainer: L.Trainer, kind: type) -> L.Callback | None:
    return next((c for c in trainer.callbacks if isinstance(c, kind)), None)


def publish_to_wandb(trainer: L.Trainer, figures: dict) -> None:
    """Put `figures` (nested dicts allowed) into the summary of every W&B run of `trainer`, so a
    run's table in W&B shows its final losses and compute whatever was logged last."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(figures)


class RunSummary(L.Callback):
    """Final metrics, update counts, compute accounting and checkpoint paths of a `fit`, as
    `<run dir>/summary.json`; the same figures go into the W&B run summary. A resumed session
    writes the run's summary: a metric it did not log again (no validation since it resumed, or
    nothing left to train) keeps the value the run's summary already holds.

    Args:
        filename: name of the summary file inside the run directory.
    """

    def __init__(self, filename: str = "summary.json"):
        self.filename = filename

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        run_dir = run_directory(trainer)
        checkpoint = trainer.checkpoint_callback
        accounting, budget = _find(trainer, ComputeAccounting), _find(trainer, ComputeBudget)
        summary = {
            "run_dir": str(run_dir),
            "module": type(pl_module).__name__,
            "method": pl_module.method,  # spsa, soma, ddpp, eggroll or bptt
            "global_step": trainer.global_step,
            "metrics": dict(sorted({**self._earlier_metrics(trainer, run_dir),
                                    **{k: _plain(v) for k, v in trainer.callback_metrics.items()}}.items())),
            "last_checkpoint": getattr(checkpoint, "last_model_path", None) or None,
            "best_checkpoint": getattr(checkpoint, "best_model_path", None) or None,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "compute": asdict(accounting.report) if accounting is not None and accounting.report else None,
            "budget": budget.summary() if budget is not None else None,
        }
        write_json_atomic(run_dir / self.filename, summary)
        publish_to_wandb(trainer, {**summary["metrics"], "global_step": summary["global_step"],
                                   "compute_accounting": summary["compute"], "budget": summary["budget"]})
        print(f"run directory: {run_dir}", file=sys.stderr)

    def _earlier_metrics(self, trainer: L.Trainer, run_dir: Path) -> dict:
        """The metrics of the summary an earlier session of this run wrote (a resumed `fit`), or {}."""
        path = run_dir / self.filename
        if trainer.ckpt_path is None or not path.is_file():
            return {}
        try:
            return dict(json.loads(path.read_text()).get("metrics") or {})
        except (OSError, ValueError, AttributeError):  # unreadable: this session's metrics alone
            return {}
