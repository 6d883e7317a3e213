"""`RunSummary`: writes `summary.json` into the run directory when `fit` ends and prints where."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from soma_pl.io import write_json_atomic


def _plain(value):
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


class RunSummary(L.Callback):
    """Final metrics, update counts and checkpoint paths of a `fit`, as `<run dir>/summary.json`.

    Args:
        filename: name of the summary file inside the run directory.
    """

    def __init__(self, filename: str = "summary.json"):
        self.filename = filename

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        checkpoint = trainer.checkpoint_callback
        summary = {
            "run_dir": str(run_dir),
            "module": type(pl_module).__name__,
            "global_step": trainer.global_step,
            "metrics": {k: _plain(v) for k, v in sorted(trainer.callback_metrics.items())},
            "last_checkpoint": getattr(checkpoint, "last_model_path", None) or None,
            "best_checkpoint": getattr(checkpoint, "best_model_path", None) or None,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
        }
        write_json_atomic(run_dir / self.filename, summary)
        print(f"run directory: {run_dir}", file=sys.stderr)
