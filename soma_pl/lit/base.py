"""What every byte-LM LightningModule shares: the stacked-expert model, its optimizer and
learning-rate decay, update logging (`log_update`), evaluation, checkpoints.

Evaluation follows Table 1: windows of 1,025 bytes, the loss scores the targets after the first
256 input bytes (768 targets), mean cross entropy in nats/byte, reduced correctly under DDP.

Validation has two parts. The ensemble-validation windows (dataloader 0) are only scored and
logged as `val/loss`: they give the scaling curves and the sweep selection, never a training
decision. Each expert's own expert-validation split, the held-out 1% of its training documents
(dataloader 1; N = 1 is one expert), is logged as `expert/<e>/val_loss` and handed to
`after_validation`, where every module decays each expert's learning rate on its own loss
(`ExpertPlateau`: one multiplier per expert, N = 1 included).

Evaluation of several experts routes each window on its first 256 bytes and averages the top-k
experts' probabilities (`Routing`, the field `routing`); one expert is scored alone.

Numbers are checked where they are given: every constructor refuses a setting that cannot work,
naming its key. A NaN or infinite training loss or weight (`check_finite`, every step), validation
loss, or checkpoint weight (written or read) stops the run with one line; no checkpoint holds one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from soma_pl import ROUTE_BYTES, VAL_WINDOWS, WINDOW_BYTES
from soma_pl.contracts import HoldsEvalSets, RecordsData, UpdateRecord
from soma_pl.errors import ConfigError, SomaError
from soma_pl.eval.bootstrap import document_bootstrap
from soma_pl.eval.checks import check_finite, largest_weights
from soma_pl.eval.ensemble import EnsembleScores, score_windows
from soma_pl.eval.metrics import NatsPerByte, PerExpertNats
from soma_pl.io import write_json_atomic
from soma_pl.lit.args import KEY, Group, ModelShape, arg_group, plain, require
from soma_pl.lit.optim import LR_KEY, check_positive_lr, optimizer_factory, optimizer_spec
from soma_pl.lit.plateau import ExpertPlateau, PlateauConfig, scale_gradients, scale_updates, steps_with_gradient
from soma_pl.lit.routing import Routing
from soma_pl.lit.starts import HeadTraining, Init, head_mode, start_checkpoint, warm_start
from soma_pl.models.checkpoints import first_nonfinite
from soma_pl.models.stacked import ExpertStack, HeadMode, StackedExperts


class NonFiniteError(SomaError):
    """A loss or weight became NaN or infinite: the run stops and writes no checkpoint of it."""


def finite_experts(model: StackedExperts) -> Tensor:
    """`[E]` bool: whether each expert's weights are all finite (a shared tensor counts for every expert)."""
    return torch.isfinite(largest_weights(model))


class ByteLMModule(L.LightningModule, ABC):
    # Abstract, so that the CLI gives a module named by `--model` its own defaults, not this class's.
    """Base of both modules (`ZOModule`, `BPTTModule`): the model, its optimizer and learning-rate
    decay, update logging, routed evaluation, checkpoints.

    Args:
        num_experts: experts in the stacked model (1: monolithic).
        shape: the model's width, layers, head width and forward chunking.
        head_training: how the tied head learns (`soma_pl.lit.starts.HeadTraining`): a frozen head is
            one head shared by the experts, any other each expert's own.
        init: `seed` (every expert a copy of `seed_checkpoint`) or `random`; None: `seed` when
            `seed_checkpoint` is given, else `random`.
        seed_checkpoint: a monolithic checkpoint of the same width, copied at `setup` into a fresh
            fit (and into `validate` or `test` without `--ckpt_path`); ignored when resuming.
        train_context: bytes of context per training window (the paper: 1,024); training uses the
            first `train_context + 1` bytes of each window, so CPU runs can train on less.
        score_from: first target position scored in evaluation (the paper: 256).
        optimizer: the torch optimizer (a factory from the config, or its `optimizer_spec` dict).
        plateau: the learning-rate decay on the expert-validation split.
        router_path: with N > 1, the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
        top_k: with N > 1, experts averaged in evaluation (the paper: 4; capped at N).
    """

    def __init__(self, num_experts: int = 1, shape: ModelShape = ModelShape(),
                 head_training: HeadTraining = HeadTraining.trainable, init: Init | None = None,
                 seed_checkpoint: str | None = None, train_context: int = 1024, score_from: int = ROUTE_BYTES,
                 optimizer: Callable | dict = torch.optim.SGD, plateau: PlateauConfig = PlateauConfig(),
                 router_path: str | None = None, top_k: int = 4):
        super().__init__()
        require(num_experts >= 1, f"{KEY}.num_experts", num_experts, ">= 1")
        require(1 <= train_context < WINDOW_BYTES, f"{KEY}.train_context", train_context,
                f"in [1, {WINDOW_BYTES - 1}]")
        # At least one scored target in a window of WINDOW_BYTES bytes (WINDOW_BYTES - 1 targets).
        require(0 <= score_from < WINDOW_BYTES - 1, f"{KEY}.score_from", score_from, f"in [0, {WINDOW_BYTES - 2}]")
        # Every constructor's arguments, as plain values (argument groups as dicts, enums as their
        # values): what a weights-only load reads.
        self.save_hyperparameters(ignore=["optimizer"])
        for key, value in list(self.hparams.items()):
            self.hparams[key] = plain(value)
        self.keep_optimizer(optimizer)
        self.shape = self.arg_group(self.shape_type, shape, "shape")
        self.plateau_config = self.arg_group(PlateauConfig, plateau, "plateau")
        self.head_training = HeadTraining(head_training)
        self.model = self.build_model(num_experts)
        if head_mode(self.head_training) is HeadMode.shared:
            self.model.head.requires_grad_(False)  # a frozen head, the seed's or a random one
        self.seed_checkpoint = start_checkpoint(init, seed_checkpoint)
        """The seed checkpoint a fresh fit starts from; None: random weights."""
        self.plateau = ExpertPlateau(num_experts, self.plateau_config)
        """Each expert's learning-rate multiplier, floored at `plateau.min_lr`."""
        self.routing = Routing(num_experts, top_k, router_path)
        """The router and top-k of an ensemble (N > 1)."""
        self.train_context = train_context
        self.score_from = score_from
        self.automatic_optimization = False  # every module steps its optimizer itself, once per batch
        self.val_loss = NatsPerByte()
        self.test_loss = NatsPerByte()
        self.expert_val_loss = PerExpertNats(num_experts)
        self._metrics = {"val": self.val_loss, "test": self.test_loss}
        self._records: dict[str, list] = {}
        self.last_update: UpdateRecord | None = None
        """The most recent update's cost, set by `log_update`."""

    shape_type: ClassVar[type] = ModelShape
    """The dataclass of `shape`, which `build_model` reads."""

    def build_model(self, num_experts: int) -> ExpertStack:
        """The stacked model: the paper's LSTM experts (App. C)."""
        return StackedExperts(num_experts, self.shape.width, self.shape.embed_dim, self.shape.num_layers,
                              head_mode(self.head_training), self.shape.time_chunk)

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyperparameters the loggers record: as plain values, like the checkpoint's."""
        return AttributeDict({key: plain(value) for key, value in super().hparams_initial.items()})

    def arg_group(self, cls: type[Group], value: Group | dict, name: str) -> Group:
        """The argument group `name` as its dataclass `cls` (from a dict too, see `args.arg_group`),
        kept whole in the hyperparameters (every field, as plain values)."""
        group = arg_group(cls, value, name)
        self.hparams[name] = plain(group)
        return group

    def keep_optimizer(self, optimizer: Callable | dict) -> None:
        """Keep the optimizer factory, and its description in the hyperparameters, so
        `load_from_checkpoint` restores it."""
        self.optimizer_factory = optimizer_factory(optimizer)
        spec = optimizer_spec(optimizer)
        if spec is not None:
            self.hparams["optimizer"] = spec
            if spec.get("init_args", {}).get("lr") is not None:  # checked here, before any data is prepared
                check_positive_lr(spec["init_args"]["lr"])

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        """The configured optimizer over `params`, its learning rate checked (`configure_optimizers`)."""
        optimizer = self.optimizer_factory(params)
        for group in optimizer.param_groups:
            check_positive_lr(group["lr"])
        return optimizer

    def configure_optimizers(self):
        optimizer = self.build_optimizer(self.trainable_parameters().values())
        self.plateau.floor_at(optimizer.param_groups[0]["lr"])
        return optimizer

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the optimizer steps: every trained one of `trained_model`."""
        return {n: p for n, p in self.trained_model.named_parameters() if p.requires_grad}

    @property
    def experts(self) -> range:
        """Global indices of the experts this process trains (expert-parallel SOMA: its share)."""
        return range(self.model.num_experts)

    def current_lr(self) -> Tensor:
        """The learning rate now: the optimizer's times the experts' mean multiplier (a tensor, read
        by the loggers when they write, not at every step)."""
        return self.optimizers().param_groups[0]["lr"] * self.plateau.scale.mean()

    def step_optimizer(self) -> None:
        """Step the optimizer on the `.grad`s just set and clear them, each expert's update scaled by
        its own learning-rate multiplier (the optimizer's learning rate stays the configured one)."""
        optimizer = self.optimizers()
        experts = {n: p for n, p in self.trained_model.expert_parameters().items() if p.requires_grad}
        scale = self.plateau.scale[self.experts.start : self.experts.stop]
        if steps_with_gradient(getattr(optimizer, "optimizer", optimizer)):
            scale_gradients(experts, scale)  # plain SGD: sₑ·gₑ is the scaled step, with no copy of the weights
            optimizer.step()
        else:  # the step is not proportional to the gradient: scale the update itself
            before = {name: param.detach().clone() for name, param in experts.items()}
            optimizer.step()
            scale_updates(experts, before, scale)
        optimizer.zero_grad(set_to_none=True)

    def log_update(self, losses: Tensor, seconds: float, forwards: int, **extra: float | Tensor) -> None:
        """Record one update's cost in `last_update` and log it.

        Not Lightning's `LearningRateMonitor`: the decay is a per-expert multiplier, not the optimizer's lr.
        Not its `ThroughputMonitor`: an update forwards each window 2·n_pert times, which no batch size counts.

        Args:
            losses: `[E]` this process's experts' training losses (logged per expert when E > 1).
            seconds: the update's wall time; forwards: the token forwards it evaluated on this process.
            extra: more values, logged as `train/<name>` (`eps`, `sigma`, ...).
        """
        losses = losses.detach()
        self.last_update = UpdateRecord(seconds, forwards, losses.numel())
        self.log("train/loss", losses.mean(), prog_bar=True)
        self.log_dict({"train/lr": self.current_lr(), "train/update_seconds": seconds,
                       "train/token_forwards_per_s": forwards / max(seconds, 1e-12),
                       **{f"train/{name}": value for name, value in extra.items()}})
        if self.model.num_experts > 1:
            self.log_dict({f"expert/{e}/train_loss": loss for e, loss in zip(self.experts, losses, strict=False)})

    def check_finite(self, step: int, losses: Tensor) -> None:
        """Stop at the first non-finite training loss or weight, naming the step and the expert.

        Every step, after the update and outside its timing: one `[2, E]` read to the host. On GPU
        `UpdateClock` has already synchronised the device, so the read waits only for this check's
        own pass over the weights, never for queued training work.

        Args:
            step: the update's index (`global_step` before it).
            losses: `[E]` this step's training losses of this process's experts (`experts`), whose
                weights (`trained_model`) were just updated.
        """
        model = self.trained_model
        finite = torch.stack([torch.isfinite(losses.detach()).reshape(-1).to(model.w_hh.device),
                              finite_experts(model)]).tolist()
        for what, row in zip(("training loss", "weights after the update"), finite, strict=False):
            bad = [self.experts[i] for i, ok in enumerate(row) if not ok]
            if bad:
                raise NonFiniteError(f"non-finite {what} at step {step} (expert {', '.join(map(str, bad))}): "
                                     f"lower the learning rate ({LR_KEY}) or eps/sigma, or resume from the last "
                                     f"checkpoint with smaller ones")

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
        return self.routing.eval_k

    def ranking(self, windows: Tensor) -> Tensor:
        """Expert order per window, best first: `[b, E]` (the router's)."""
        return self.routing.ranking(windows)

    def setup(self, stage: str) -> None:
        # Without a checkpoint the module is its seed (a fresh fit starts from it; validate and test
        # score it); with one, the weights come from the checkpoint.
        data = self.trainer.datamodule
        if self.seed_checkpoint and self.trainer.ckpt_path is None:
            warm_start(self.model, self.seed_checkpoint, self.head_training,
                       data.data_in_use() if isinstance(data, RecordsData) else None)
        self.routing.setup(data, resuming=self.trainer.ckpt_path is not None)

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
        losses = self.trained_model.window_losses(windows, score_from=self.score_from, reduce_dtype=torch.float64)
        self.expert_val_loss.update(torch.where(valid, losses, 0.0).sum(1), valid.sum(1))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Per-window scored loss (nats/byte) of each expert: `{"index": [b], "loss": [E, b]}`."""
        windows, index = batch
        return {"index": index, "loss": self.window_losses(windows)}

    def on_validation_epoch_end(self) -> None:
        value = self._finish_evaluation("val")
        held_out = self._finish_expert_validation()
        if self.trainer.state.fn == TrainerFn.FITTING:
            self._check_finite_validation(value, held_out)
        if (self.trainer.state.fn == TrainerFn.FITTING and not self.trainer.sanity_checking and held_out is not None
                and self.plateau_config.checks_at(self.trainer.global_step)):
            self.after_validation(held_out)

    def _check_finite_validation(self, value: Tensor, held_out: Tensor | None) -> None:
        """Stop before a non-finite validation loss drives a decay or a checkpoint is written."""
        losses = {"validation loss (val/loss)": [float(value)]}
        if held_out is not None:
            losses["expert-validation loss"] = held_out.tolist()
        for what, values in losses.items():
            bad = [str(e) for e, loss in enumerate(values) if not math.isfinite(loss)]
            if bad:
                expert = f" (expert {', '.join(bad)})" if what.startswith("expert") else ""
                raise NonFiniteError(f"non-finite {what} at step {self.trainer.global_step}{expert}: lower the "
                                     f"learning rate ({LR_KEY}) or eps/sigma")

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
        """Log `<stage>/loss`; outside `fit`, also its document-bootstrap interval and a JSON report;
        during `fit`, each validation window by window (`_record_validation`)."""
        metric = self._metrics[stage]
        value = metric.compute()
        metric.reset()
        if self.trainer.state.fn != TrainerFn.FITTING:  # `fit` stops on its own check, naming the step
            path = self.trainer.ckpt_path
            check_finite(f"{stage}/loss", value, f"checkpoint {path}" if path else "the configured model")
        self.log(f"{stage}/loss", value, prog_bar=stage == "val")
        records = self._records.pop(stage, [])
        if records and self.trainer.state.fn != TrainerFn.FITTING:
            self._report(stage, records)
        elif records and not self.trainer.sanity_checking:
            self._record_validation(records)
        return value

    def _gathered(self, stage: str, records: list[tuple[Tensor, Tensor, Tensor]]
                  ) -> tuple[np.ndarray, np.ndarray, Tensor, Tensor, np.ndarray] | None:
        """Every rank's scored windows in the split's order: their indices, the `eval_k` ensemble's
        loss of each, the losses by k, the experts' losses and the windows' documents; None without
        the split's documents. Every rank must call it (all_gather)."""
        # all_gather adds a leading rank dimension under DDP; flatten it away.
        index, by_k, experts = (self.all_gather(torch.cat(parts)) for parts in zip(*records, strict=False))
        index, by_k = index.reshape(-1), by_k.reshape(-1, by_k.shape[-1])
        experts = experts.reshape(-1, experts.shape[-1])
        data = self.trainer.datamodule
        evalset = (data.val_set if stage == "val" else data.test_set) if isinstance(data, HoldsEvalSets) else None
        if evalset is None:
            return None
        order = index.argsort()  # the windows in the split's order, whichever rank scored them
        index, losses = index[order].cpu().numpy(), by_k[order, self.eval_k - 1].double().cpu().numpy()
        return index, losses, by_k, experts, evalset.doc_ids[index]

    def _record_validation(self, records: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        """A fit's validation, window by window: `val_windows/<updates>.json` in the logger's folder
        (`soma_pl.VAL_WINDOWS`; none without a logger), so that two runs' validation curves can be
        compared by a paired document bootstrap at any budget."""
        if not self.trainer.loggers:
            return
        gathered = self._gathered("val", records)
        log_dir = self.trainer.log_dir  # a broadcast under DDP: every rank must ask (None under fast_dev_run)
        if gathered is None or not self.trainer.is_global_zero or not log_dir:
            return
        index, losses, _, _, documents = gathered
        updates = self.trainer.global_step
        write_json_atomic(Path(log_dir) / VAL_WINDOWS / f"{updates}.json", {
            "updates": updates, "k": self.eval_k, "window_index": index.tolist(), "window_losses": losses.tolist(),
            "doc_ids": documents.tolist()})

    def _report(self, stage: str, records: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        gathered = self._gathered(stage, records)
        if gathered is None:
            return
        index, losses, by_k, experts, documents = gathered
        interval = document_bootstrap(losses, documents)
        self.log_dict({f"{stage}/loss_ci_low": interval.low, f"{stage}/loss_ci_high": interval.high})
        log_dir = self.trainer.log_dir  # a broadcast under DDP: every rank must ask
        if self.trainer.is_global_zero and log_dir:
            write_json_atomic(Path(log_dir) / f"{stage}_scores.json", {
                "stage": stage, "k": self.eval_k, "loss": interval.mean,
                "bootstrap_95": [interval.low, interval.high], "documents": interval.documents,
                "windows": interval.windows, "loss_by_k": by_k.double().mean(0).tolist(),
                "expert_losses": experts.double().mean(0).tolist(),
                # per window, so that two runs on one split can be compared by a paired document bootstrap
                "window_index": index.tolist(), "window_losses": losses.tolist(), "doc_ids": documents.tolist(),
            })

    def after_validation(self, held_out: Tensor) -> None:
        """Learning-rate decay on each expert's expert-validation loss `held_out [E]` (never on
        the ensemble-validation set) at the update count now; N = 1 is one expert, its held-out 1%
        training split."""
        self.plateau.step(held_out, self.trainer.global_step)
        if self.model.num_experts > 1:
            self.log_dict(self.plateau.learning_rates(self.optimizers().param_groups[0]["lr"]))

    @property
    @abstractmethod
    def method(self) -> str:
        """The method this module trains: `spsa`, `soma`, `ddpp`, `eggroll` or `bptt`."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record the module class and the router; refuse to write weights that are not finite."""
        checkpoint["module_class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        name = _nonfinite_weight(checkpoint)
        if name is not None:
            raise NonFiniteError(f"refusing to write a checkpoint at step {checkpoint.get('global_step')}: "
                                 f"'{name}' holds NaN or infinite values")
        self.routing.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint of another module class, with non-finite weights, or whose weights
        have other shapes (naming both shapes). The optimizer keeps the checkpoint's state but steps
        at the configured learning rate: the rate a resumed run was configured with (the decay is the
        plateau's multiplier, restored with the checkpoint), or another that a continuation sets
        (Table 6's settings, each continued from one checkpoint with its optimizer state)."""
        path = getattr(self._trainer, "ckpt_path", None) or "checkpoint"
        written_by = checkpoint.get("module_class") or (checkpoint.get("hyper_parameters") or {}).get("_class_path")
        if written_by and type(self).__name__ != str(written_by).rpartition(".")[2]:
            raise ConfigError(f"{path} was written by {written_by}, the configured model is "
                              f"{type(self).__module__}.{type(self).__qualname__}: resume with the same module "
                              f"(--model={written_by}); start another module from it with seed_checkpoint")
        name = _nonfinite_weight(checkpoint)
        if name is not None:
            raise NonFiniteError(f"{path}: '{name}' holds NaN or infinite values (a diverged run): resume from an "
                                 f"earlier checkpoint")
        own = self.state_dict()
        for name, tensor in checkpoint.get("state_dict", {}).items():
            if name in own and tuple(own[name].shape) != tuple(tensor.shape):
                raise ConfigError(f"checkpoint parameter '{name}' has shape {list(tensor.shape)}, "
                                  f"the configured model has {list(own[name].shape)}")
        lr = ((self.hparams.get("optimizer") or {}).get("init_args") or {}).get("lr")
        for state in checkpoint.get("optimizer_states", ()) if lr is not None else ():
            for group in state.get("param_groups", ()):
                group["lr"] = lr
        self.routing.load(checkpoint)


def _nonfinite_weight(checkpoint: dict) -> str | None:
    """The first model weight of a checkpoint holding NaN or infinity (the decay's `plateau.best`
    starts infinite and is not a weight)."""
    state = checkpoint.get("state_dict", {})
    return first_nonfinite({name: value for name, value in state.items() if name.startswith("model.")})
