"""`ZOModule`: zero-order training of one model (N = 1, monolithic) or of N experts (SOMA).

The estimator is a component, one of two typed argument groups (`soma_pl.lit.estimators`):
`spsa` (central-difference SPSA; with `spsa.exchange` set, DDPP across processes) or `eggroll`
(low-rank evolution strategies). Manual optimization: each step the estimate goes into `.grad` and a
real torch optimizer (from the config) steps. The perturbation scale (SPSA's ε, EGGROLL's σ) either
stays fixed or follows the learning rate (`EpsSchedule.proportional`): when the learning rate decays,
the scale decays by the same factor (per expert under per-expert decay). A fresh fit may start every
expert from a seed checkpoint (`seed_checkpoint`). Zero-order modules run in full precision only: a
bf16 forward puts a 1.3% error into each loss difference.

With N experts (SOMA) every step each expert draws its own micro-batch from its own shard (`[E, B,
T]` batches from `ByteDataModule(experts_dir=...)`) and its own directions, and its estimate uses
only its own loss (FSO): nothing is exchanged between experts. All experts × directions run as one
batched forward. Each expert's learning rate and ε decay on its own expert-validation split.
Evaluation routes each window on its first 256 bytes and averages the top-k experts' probabilities
(Table 1, Fig. 16).

Processes: N experts fit on W ≤ N processes expert-parallel (rank r owns a contiguous share of the
experts, reads only their shards and trains them with no per-step communication, `ExpertParallel`);
one model fits on several processes only under DDPP (`spsa.exchange`); any other multi-process fit
is refused (each process would train its own, diverging replica).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.contracts import BatchesWindows, UpdateClock, UpdateMemory
from soma_pl.distributed import RankSplit, rank_share
from soma_pl.errors import ConfigError
from soma_pl.lit.args import KEY, ModelShape
from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.ddpp import Exchange
from soma_pl.lit.estimators import EGGROLLArgs, EpsSchedule, Estimator, SPSAArgs, Update
from soma_pl.lit.optim import ZOAdam
from soma_pl.lit.parallel import ExpertParallel, keep_buffers_local
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.starts import HeadTraining, Init, head_gradient
from soma_pl.models.stacked import StackedExperts

FULL_PRECISION = ("32-true", "64-true")
"""The precisions zero-order modules run in: a bf16 forward puts a 1.3% error into each δ."""

SMALL_EPS = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-3}
"""Below these ε, central differences lose their precision in the dtype (float32 at ε = 5e-6, width
32: an error of 0.046 in δ)."""


def small_eps_warning(eps: float | Tensor, dtype: torch.dtype) -> str | None:
    """A warning when the smallest ε is below what `dtype` resolves; None when it is not."""
    floor, smallest = SMALL_EPS.get(dtype), float(torch.as_tensor(eps).min())
    if floor is None or smallest >= floor:
        return None
    return (f"eps has decayed to {smallest:.3g}, below {floor:g}: central differences in {dtype} lose their "
            f"precision there; set plateau.min_lr (or eps_schedule: constant)")


def check_full_precision(module: ByteLMModule) -> None:
    """Refuse a mixed-precision trainer: loss differences need the full-precision forward."""
    precision = str(module.trainer.precision)
    if precision not in FULL_PRECISION:
        raise ConfigError(f"trainer.precision={precision}: {type(module).__name__} estimates gradients from loss "
                          f"differences, which mixed precision ruins; use one of {', '.join(FULL_PRECISION)}")


class ZOModule(ByteLMModule):
    """Zero-order training of a byte LM: monolithic (N = 1) or N experts trained independently (SOMA).

    Args:
        num_experts: N (1: monolithic; Table 2's SOMA: 2, 8, 256).
        shape: each expert's shape (Table 2's widths: 509 monolithic; 361, 181, 32 for N = 2, 8, 256).
        spsa: the SPSA estimator's settings (ε, directions, micro-batch, ε schedule, DDPP exchange).
        eggroll: the EGGROLL estimator's settings; given, EGGROLL is the estimator (of one model) and
            `spsa` is not used (with `head_training: trainable` or a frozen head).
        head_training: `decoder_only` (the paper's: each expert's head stepped by the decoder-path
            delta rule, Eq. 7, never perturbed), `trainable` (perturbed with the body: the EGGROLL
            reference's convention), `frozen_shared` or `frozen_random`; `eggroll` takes any but
            `decoder_only`.
        init: `seed` (every expert a copy of `seed_checkpoint`) or `random`; None: `seed` when
            `seed_checkpoint` is given, else `random`. Configs say it explicitly, so a sweep's sides
            can be compared.
        seed_checkpoint: a monolithic checkpoint of the same width (e.g. from `configs/seed.yaml`).
            Ignored when resuming (`--ckpt_path`).
        router_path: with N > 1, the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
        top_k: with N > 1, experts averaged in evaluation (the paper: 4; capped at N).
        optimizer: the torch optimizer the estimate steps: the paper's Adam with coupled weight decay
            (`ZOAdam`) by default; plain `torch.optim.SGD` stays selectable (set its lr in YAML).
        plateau: the learning-rate (and, proportionally, ε) decay on the expert-validation split:
            each expert's own with N > 1.
        seed: seed of the perturbations (regenerated from seed, step, expert, direction).
        train_context, score_from: see `ByteLMModule`.
    """

    def __init__(self, num_experts: int = 1, shape: ModelShape = ModelShape(), spsa: SPSAArgs = SPSAArgs(),
                 eggroll: EGGROLLArgs | None = None, head_training: HeadTraining = HeadTraining.decoder_only,
                 init: Init | None = None, seed_checkpoint: str | None = None, router_path: str | None = None,
                 top_k: int = 4, optimizer: OptimizerCallable = ZOAdam,
                 plateau: PlateauConfig = PlateauConfig(), seed: int = 0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES):
        super().__init__(num_experts=num_experts, shape=shape, head_training=head_training, init=init,
                         seed_checkpoint=seed_checkpoint, train_context=train_context, score_from=score_from,
                         optimizer=optimizer, plateau=plateau, router_path=router_path, top_k=top_k)
        self.estimator: Estimator = self.arg_group(SPSAArgs, spsa, "spsa")
        """The estimator's settings, which also compute its update (`soma_pl.lit.estimators.Estimator`)."""
        if eggroll is not None:
            if self.estimator != SPSAArgs():
                rank_zero_warn(f"{KEY}.spsa is not used: {KEY}.eggroll makes EGGROLL the estimator")
            self.estimator = self.arg_group(EGGROLLArgs, eggroll, "eggroll")
        self.estimator.check_module(self)
        if self.head_training is HeadTraining.decoder_only and isinstance(self.estimator, EGGROLLArgs):
            # EGGROLL's `.grad` is σ₀/√N·Σ φ·ε (the reference's step), not a gradient's scale.
            raise ConfigError(f"{KEY}.head_training=decoder_only (the default) steps the head by its exact gradient "
                              f"with the estimate's learning rate, which {KEY}.eggroll's step convention does not "
                              f"share: use head_training: trainable (or frozen_*) with eggroll")
        self.seed = seed
        self.parallel = ExpertParallel(self, enabled=num_experts > 1)
        """This rank's share of the experts when fitting N > 1 on several processes."""
        self.eps_warned = False
        self.warmed_up = False

    @property
    def method(self) -> str:
        """`eggroll`, `ddpp` (SPSA with an exchange), `soma` (SPSA of N > 1 experts) or `spsa`."""
        if isinstance(self.estimator, EGGROLLArgs):
            return "eggroll"
        if self.exchange is not None:
            return "ddpp"
        return "soma" if self.model.num_experts > 1 else "spsa"

    @property
    def exchange(self) -> Exchange | None:
        """The DDPP exchange of an SPSA estimator (None: none)."""
        return getattr(self.estimator, "exchange", None)

    @property
    def rank_split(self) -> RankSplit:
        """How ranks share the training data: DDPP reads the same global batch on every rank."""
        return RankSplit.replicated if self.exchange is not None else self.parallel.rank_split

    @property
    def experts(self) -> range:
        return self.parallel.experts

    @property
    def trained_model(self) -> StackedExperts:
        return self.parallel.trained_model

    def setup(self, stage: str) -> None:
        check_full_precision(self)
        if stage == "fit" and self.trainer.world_size > 1:
            self.check_world_size(self.trainer.world_size)
        data = self.trainer.datamodule
        if stage == "fit" and isinstance(data, BatchesWindows) and isinstance(data.batch_size, int):
            self.estimator.check_batch_size(data.batch_size)  # before the first step, not at it
        super().setup(stage)  # the warm start, then the router
        self.parallel.setup()
        if self.exchange is not None and self.trainer.world_size > 1:
            keep_buffers_local(self)

    def check_world_size(self, world_size: int) -> None:
        """Several processes share out N > 1 experts, or one model's directions (DDPP); any other
        multi-process fit would train diverging replicas."""
        if self.exchange is not None:
            return  # each step's directions are dealt out: a rank may get none
        if self.model.num_experts > 1:
            self.parallel.check_world_size(world_size)
            self._check_groups_on_ranks(world_size)
            return
        raise ConfigError(f"{type(self).__name__} of one model trains one replica per process, so {world_size} "
                          f"processes would train {world_size} diverging replicas: share its directions out with "
                          f"{KEY}.spsa.exchange=estimates (DDPP), or set trainer.devices=1, num_nodes=1")

    def _check_groups_on_ranks(self, world_size: int) -> None:
        """A summed loss is evaluated where its experts are: no group may span two ranks' shares."""
        grouping = getattr(self.estimator, "loss_grouping", 1)
        shares = [rank_share(self.model.num_experts, rank, world_size) for rank in range(world_size)]
        if any(share.start % grouping or share.stop % grouping for share in shares):
            raise ConfigError(f"{KEY}.spsa.loss_grouping={grouping}: {world_size} processes share "
                              f"{self.model.num_experts} experts so that a group of {grouping} would span two of "
                              f"them; choose a number of processes whose shares hold whole groups")

    def configure_optimizers(self):
        self.parallel.take_share()  # after setup and any checkpoint restore: `model` holds the start weights
        return super().configure_optimizers()

    def training_tokens(self, batch: Tensor) -> Tensor:
        """`batch: [E, B, 1025] uint8` (E: this process's experts) → `[E, B, train_context + 1]`; the
        batch must split as the estimator needs."""
        experts = self.experts
        if batch.dim() != 3 or batch.shape[0] != len(experts):
            which = "the model has" if len(experts) == self.model.num_experts else \
                f"this process trains experts {experts.start}..{experts.stop - 1}:"
            raise ConfigError(f"training batch of shape {tuple(batch.shape)}: {which} {len(experts)} experts, "
                              f"expected [{len(experts)}, B, T]")
        self.estimator.check_batch_size(batch.shape[1])
        return batch[..., : self.train_context + 1]

    def perturbed_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the estimator perturbs, `[E, ...]` each: the trainable ones but a
        `decoder_only` head, which the delta rule steps instead (a shared head is never trained)."""
        skip = "head" if self.head_training is HeadTraining.decoder_only else None
        return {name: param for name, param in self.trainable_parameters().items() if name != skip}

    def update_memory(self) -> UpdateMemory:
        """What one update holds at once, at least: its estimator's loss call (`Estimator.update_memory`)."""
        return self.estimator.update_memory(self)

    def loss_fn(self, params: dict[str, Tensor], tokens: Tensor) -> Tensor:
        """Per-group losses of the trained experts under `params [G, ...]` (the others unperturbed)."""
        return self.trained_model.loss_per_group(params, tokens)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        step = self.global_step
        self.warm_up(tokens)
        clock = UpdateClock(tokens.device)
        clock.start()
        scale = self.current_scale()
        update = self.with_head_gradient(self.estimator.estimate(self, tokens, scale), tokens)
        for name, param in self.trainable_parameters().items():
            param.grad = update.gradient[name]
        self.step_optimizer()
        clock.stop()
        self.check_finite(step, update.loss)  # the step's one host read
        self.log_update(update.loss, clock.seconds(), update.forwards,
                        **{self.estimator.scale_name: torch.as_tensor(scale).mean()}, **update.logs)

    def with_head_gradient(self, update: Update, tokens: Tensor) -> Update:
        """`update` completed with the head's gradient under `decoder_only` (its forward's bytes
        counted with the estimate's); any other head comes from the estimate or is frozen."""
        if self.head_training is not HeadTraining.decoder_only:
            return update
        count, windows, length = tokens.shape
        return replace(update, gradient={**update.gradient, "head": head_gradient(self.trained_model, tokens)},
                       forwards=update.forwards + count * windows * (length - 1))

    @torch.no_grad()
    def warm_up(self, tokens: Tensor) -> None:
        """Once per process, before the first update's clock: one forward of one window through the
        grouped kernel the estimator runs (two weight sets per expert), so the native kernel's build
        (about a minute on a fresh machine) and the libraries' first-call set-up are not counted as
        an update's time (Table 3 sums measured update times). It reads no random numbers and changes
        no weight."""
        if self.warmed_up:
            return
        self.warmed_up = True
        params = {name: param.detach().repeat_interleave(2, 0) for name, param in self.perturbed_parameters().items()}
        self.loss_fn(params, tokens[:, :1].repeat_interleave(2, 0))
        if self.head_training is HeadTraining.decoder_only:
            head_gradient(self.trained_model, tokens[:, :1])  # the delta rule's forward runs one weight set per expert

    def current_scale(self) -> float | Tensor:
        """The perturbation scale now: ε₀ (σ₀) times each expert's learning-rate multiplier under a
        proportional schedule, so that ε halves with lr and stops with it at `plateau.min_lr` (§4).
        `[E]` (this process's experts) with several experts; one number, from the multiplier's host
        copy, for one model (whose estimators take a number)."""
        estimator = self.estimator
        proportional = estimator.scale_schedule is EpsSchedule.proportional
        if self.model.num_experts == 1:
            return estimator.initial_scale * (self.plateau.multipliers[0] if proportional else 1.0)
        multiplier = self.plateau.scale[self.experts.start : self.experts.stop]
        return estimator.initial_scale * (multiplier if proportional else torch.ones_like(multiplier))

    def after_validation(self, held_out: Tensor) -> None:
        super().after_validation(held_out)
        self.warn_small_eps(self.current_scale())

    def warn_small_eps(self, eps: float | Tensor) -> None:
        """Warn once per run when ε falls below the precision of the model's dtype (checked where it
        decays, after a validation: no per-step cost)."""
        message = None if self.eps_warned else small_eps_warning(eps, self.model.w_hh.dtype)
        if message:
            rank_zero_warn(message)
            self.eps_warned = True

    def on_validation_epoch_start(self) -> None:
        self.parallel.gather_weights()

    def gather_expert_losses(self, losses: Tensor) -> Tensor:
        return self.parallel.gather_losses(losses)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.parallel.save(checkpoint, list(self.trainable_parameters().values()))
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.parallel.load(checkpoint)
