"""What every byte-LM LightningModule shares: the stacked-expert model, evaluation, checkpoints.

Evaluation follows Table 1: windows of 1,025 bytes, the loss scores the targets after the first
256 input bytes (768 targets), mean cross entropy in nats/byte, reduced correctly under DDP.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.errors import ConfigError
from soma_pl.eval.metrics import NatsPerByte
from soma_pl.models.experts import HeadMode, StackedExperts


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

    def _evaluate(self, batch: tuple[Tensor, Tensor], metric: NatsPerByte) -> None:
        windows, _ = batch
        losses = self.window_losses(windows).mean(0)  # E = 1 here; ensembles override evaluation
        targets = windows.shape[1] - 1 - self.score_from
        metric.update(losses.sum() * targets, losses.numel() * targets)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Per-window scored loss (nats/byte) of each expert: `{"index": [b], "loss": [E, b]}`."""
        windows, index = batch
        return {"index": index, "loss": self.window_losses(windows)}

    def on_validation_epoch_end(self) -> None:
        value = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", value, prog_bar=True, sync_dist=False)
        if self.trainer.state.fn == TrainerFn.FITTING and not self.trainer.sanity_checking:
            self.after_validation(value)

    def on_test_epoch_end(self) -> None:
        value = self.test_loss.compute()
        self.test_loss.reset()
        self.log("test/loss", value)

    def after_validation(self, value: Tensor) -> None:
        """Hook for learning-rate decay on the validation loss."""

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
