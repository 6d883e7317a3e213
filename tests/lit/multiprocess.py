"""Running the real CLI on several CPU processes (gloo), and what each rank held when it ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[2]


class SaveRankState(L.Callback):
    """Write each rank's trained weights and last update record to `<folder>/rank<r>.pt`.

    Args:
        folder: where the files go.
    """

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = getattr(pl_module, "trained_model", pl_module.model)
        experts = getattr(pl_module, "experts", range(model.num_experts))
        record = pl_module.last_update
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "experts": (experts.start, experts.stop), "token_forwards": record.token_forwards,
                    "update_experts": record.experts, "exchange_bytes": _logged(trainer, "train/exchange_bytes")},
                   self.folder / f"rank{trainer.global_rank}.pt")


def _logged(trainer: L.Trainer, name: str) -> int | None:
    """The last logged value of `name` as an integer (None when it was not logged)."""
    value = trainer.callback_metrics.get(name)
    return None if value is None else int(value)


def fit_on_processes(args: list[str], processes: int, dump: Path, timeout: float = 240) -> list[dict]:
    """`python -m soma_pl.cli fit ARGS` on `processes` CPU processes (strategy ddp); each rank's state."""
    command = [sys.executable, "-m", "soma_pl.cli", "fit", *args, "--trainer.accelerator=cpu",
               f"--trainer.devices={processes}", "--trainer.strategy=ddp",
               "--trainer.callbacks+=tests.lit.multiprocess.SaveRankState", f"--trainer.callbacks.folder={dump}"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK")}
    result = subprocess.run(command, cwd=REPO, env={**env, "WANDB_MODE": "offline"}, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(dump / f"rank{rank}.pt", weights_only=False) for rank in range(processes)]


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert first.keys() == second.keys()
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)
