"""What every byte-LM LightningModule shares: the stacked-expert model, evaluation, checkpoints.

Evaluation follows Table 1: windows of 1,025 bytes, the loss scores the targets after the first
256 input bytes (768 targets), mean cross entropy in nats/byte, reduced correctly under DDP.

Validation has two parts. The ensemble-validation windows (dataloader 0) are only scored and
logged as `val/loss`: they give the scaling curves and the sweep selection, never a training
decision. Each expert's own expert-validation split, the held-out 1% of its training documents
(dataloader 1; N = 1 is one expert), is logged as `expert/<e>/val_loss` and handed to
`after_validation`, where every module decays its learning rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.errors import ConfigError
from soma_pl.eval.bootstrap import document_bootstrap
from soma_pl.eval.ensemble import EnsembleScores, score_windows
from soma_pl.eval.metrics import NatsPerByte, PerExpertNats
from soma_pl.io import write_json_atomic
from soma_pl.lit.optim import optimizer_factory, optimizer_spec
from soma_pl.models.experts import HeadMode, StackedExperts


@dataclass(frozen=True)
class UpdateRecord:
    """What one update cost on this process; compute accounting and budgets read it."""

    seconds: float
    """Wall time of the update (CUDA synchronised before the clock is read)."""
    token_forwards: int
    """Token forward passes the update evaluated: ``2 · n_pert · E · B · T`` for SPSA, ``E · B · T``
    for BPTT (its backward is not counted)."""
    experts: int
    """Experts this process updated (all experts of the module, or a rank's slice)."""


class ByteLMModule(L.LightningModule):
    """Base of the SPSA, BPTT (and later SOMA, EGGROLL, DDPP) modules.

    Args:
        num_experts: experts in the stacked model (1: monolithic).
        width: body width d_t (Table 2: 509 for the monolithic 8.33M model).
        num_layers: LSTM layers.
        embed_dim: tied head width d_E.
        head: per-expert or one shared head.
        train_context: bytes of context per training window (the paper: 1,024); training uses the
            first `train_context + 1` bytes of each window, so CPU runs can train on less.
        score_from: first target position scored in evaluation (the paper: 256).
        time_chunk: time steps held at once in the forward (bounds activation memory).
    """

    def __init__(self, num_experts: int = 1, width: int = 509, num_layers: int = 4, embed_dim: int = 32,
                 head: HeadMode = HeadMode.PER_EXPERT, train_context: int = 1024, score_from: int = ROUTE_BYTES,
                 time_chunk: int = 64):
        super().__init__()
        if not 1 <= train_context < WINDOW_BYTES:
            raise ConfigError(f"train_context={train_context} must be in [1, {WINDOW_BYTES - 1}]")
        self.model = StackedExperts(num_experts, width, embed_dim, num_layers, head, time_chunk)
        self.train_context = train_context
        self.score_from = score_from
        self.val_loss = NatsPerByte()
        self.test_loss = NatsPerByte()
        self.expert_val_loss = PerExpertNats(num_experts)
        self._metrics = {"val": self.val_loss, "test": self.test_loss}
        self._records: dict[str, list] = {}
        self.last_update: UpdateRecord | None = None
        """The most recent update's cost, set by `training_step`."""

    def keep_optimizer(self, optimizer: Callable | dict) -> None:
        """Keep the optimizer factory, and its description in the hyperparameters (call after
        `save_hyperparameters(ignore=["optimizer"])`), so `load_from_checkpoint` restores it."""
        self.optimizer_factory = optimizer_factory(optimizer)
        spec = optimizer_spec(optimizer)
        if spec is not None:
            self.hparams["optimizer"] = spec

    def training_tokens(self, batch: Tensor) -> Tensor:
        """`batch: [E, B, 1025] uint8` → `[E, B, train_context + 1]`."""
        if batch.dim() != 3 or batch.shape[0] != self.model.num_experts:
            raise ConfigError(f"training batch of shape {tuple(batch.shape)}: the model has "
                              f"{self.model.num_experts} experts, expected [{self.model.num_experts}, B, T]")
        return batch[..., : self.train_context + 1]

    @torch.no_grad()
    def window_losses(self, windows: Tensor) -> Tensor:
        """Each expert's mean scored loss on every window: `windows [b, 1025]` → `[E, b]` nats/byte."""
        tokens = windows.unsqueeze(0).expand(self.model.num_experts, -1, -1)
        return self.model.window_losses(tokens, score_from=self.score_from)

    @property
    def eval_k(self) -> int:
        """Ensemble size whose loss is `val/loss` and `test/loss` (1: the model alone)."""
        return 1

    def ranking(self, windows: Tensor) -> Tensor:
        """Expert order per window, best first: `[b, E]`. Without a router: expert index order."""
        return torch.arange(self.model.num_experts, device=windows.device).expand(windows.shape[0], -1)

    def score(self, windows: Tensor) -> EnsembleScores:
        return score_windows(self.model, self.ranking(windows), windows, self.model.num_experts, self.score_from)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        windows, index = batch
        scores = self.score(windows)
        losses = scores.loss_by_k[:, self.eval_k - 1]
        targets = windows.shape[1] - 1 - self.score_from
        self._metrics[stage].update(losses.sum() * targets, losses.numel() * targets)
        self._records.setdefault(stage, []).append((index, scores.loss_by_k, scores.expert_losses.T))

    @property
    def trained_model(self) -> StackedExperts:
        """The experts this process trains (expert-parallel SOMA: a share of `model`)."""
        return self.model

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx == 0:
            self._evaluate(batch, "val")
        else:
            self.expert_validation_step(*batch)

    @torch.no_grad()
    def expert_validation_step(self, windows: Tensor, valid: Tensor) -> None:
        """Each expert's scored loss on its own held-out windows: `windows [E, b, 1025]`, `valid [E, b]`."""
        losses = self.trained_model.window_losses(windows, score_from=self.score_from)
        self.expert_val_loss.update(torch.where(valid, losses, 0.0).sum(1), valid.sum(1))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Per-window scored loss (nats/byte) of each expert: `{"index": [b], "loss": [E, b]}`."""
        windows, index = batch
        return {"index": index, "loss": self.window_losses(windows)}

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")
        held_out = self._finish_expert_validation()
        if self.trainer.state.fn == TrainerFn.FITTING and not self.trainer.sanity_checking and held_out is not None:
            self.after_validation(held_out)

    def _finish_expert_validation(self) -> Tensor | None:
        """Every expert's expert-validation loss `[E]` (None when there was none), logged per expert."""
        if not self.expert_val_loss.update_count:
            return None
        losses = self.gather_expert_losses(self.expert_val_loss.compute())
        self.expert_val_loss.reset()
        self.log_dict({f"expert/{e}/val_loss": loss for e, loss in enumerate(losses.tolist())})
        return losses

    def gather_expert_losses(self, losses: Tensor) -> Tensor:
        """This process's experts' losses → all experts' `[E]` (expert-parallel SOMA gathers)."""
        return losses.reshape(self.model.num_experts)

    def on_test_epoch_end(self) -> None:
        self._finish_evaluation("test")

    def _finish_evaluation(self, stage: str) -> Tensor:
        """Log `<stage>/loss`; outside `fit`, also its document-bootstrap interval and a JSON report."""
        metric = self._metrics[stage]
        value = metric.compute()
        metric.reset()
        self.log(f"{stage}/loss", value, prog_bar=stage == "val")
        records = self._records.pop(stage, [])
        if records and self.trainer.state.fn != TrainerFn.FITTING:
            self._report(stage, records)
        return value

    def _report(self, stage: str, records: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        # all_gather adds a leading rank dimension under DDP; flatten it away.
        index, by_k, experts = (self.all_gather(torch.cat(parts)) for parts in zip(*records))
        index, by_k, experts = index.reshape(-1), by_k.reshape(-1, by_k.shape[-1]), experts.reshape(-1, experts.shape[-1])
        evalset = getattr(self.trainer.datamodule, f"{stage}_set", None) if self.trainer.datamodule else None
        if evalset is None:
            return
        losses = by_k[:, self.eval_k - 1].double().cpu().numpy()
        interval = document_bootstrap(losses, evalset.doc_ids[index.cpu().numpy()])
        self.log_dict({f"{stage}/loss_ci_low": interval.low, f"{stage}/loss_ci_high": interval.high})
        log_dir = self.trainer.log_dir  # a broadcast under DDP: every rank must ask
        if self.trainer.is_global_zero and log_dir:
            write_json_atomic(Path(log_dir) / f"{stage}_scores.json", {
                "stage": stage, "k": self.eval_k, "loss": interval.mean,
                "bootstrap_95": [interval.low, interval.high], "documents": interval.documents,
                "windows": interval.windows, "loss_by_k": by_k.double().mean(0).tolist(),
                "expert_losses": experts.double().mean(0).tolist(),
            })

    def after_validation(self, held_out: Tensor) -> None:
        """Learning-rate decay on each expert's expert-validation loss `held_out [E]` (never on
        the ensemble-validation set)."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint whose weights have other shapes, naming both shapes."""
        own = self.state_dict()
        for name, tensor in checkpoint.get("state_dict", {}).items():
            if name in own and tuple(own[name].shape) != tuple(tensor.shape):
                raise ConfigError(f"checkpoint parameter '{name}' has shape {list(tensor.shape)}, "
                                  f"the configured model has {list(own[name].shape)}")


class UpdateClock:
    """Wall time of one update, synchronising CUDA first so the clock sees finished work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.started = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.started = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self.started
