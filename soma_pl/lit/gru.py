"""`GRUModule`: EGGROLL as the paper reproduced it (App. I.1), the EGGROLL authors' GRU recipe in FP32.

The model is the reference's six-layer GRU with an untied embedding and head (`soma_pl.models.gru`).
Each update:

1. **Streams.** The batch's B = population / group_size windows are read as B streams,
   `recipe.stream_bytes` (100) bytes per update, each member carrying its own recurrent state from
   the previous update's segment (nano-egg's `tokens_per_update`); a member's state starts at zero
   with each new batch of windows. A window of 1,025 bytes gives ⌊1,024 / 100⌋ = 10 updates; the
   batches that arrive while a window is being read are passed over.
2. **Members.** Member m evaluates stream m // group_size under ``W + 2^-sigma_shift·A_m·B_mᵀ``
   (rank-r, inside the matmuls) and full Gaussian noise on biases and gains; its loss is its mean
   cross entropy over the segment.
3. **Vote.** Each antithetic pair votes for its better member; a coordinate moves by the fixed
   step `float_at_step` (the SGD learning rate) where the votes pass a level-α z-test
   (`soma_pl.estimators.eggroll.sign_test_step`).

On several processes each rank evaluates its share of the pairs on the same batch and the member
losses are gathered (a number per member); every rank then makes the same update from regenerated
noise. The paper's reproduction: population 2^20, batch 256, α = 0.01, sigma_shift = 4,
float_at_step = 0.01, widths 20, 29, 58, 118, 339, on two or eight GPUs, GPU-hours = (generation +
update time) × devices: the update clock here spans both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import ClassVar

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.contracts import UpdateClock, UpdateMemory
from soma_pl.distributed import RankSplit, rank_share
from soma_pl.errors import ConfigError
from soma_pl.estimators.eggroll import EGGROLLConfig, chunk_noise, member_chunks, sign_test_step
from soma_pl.lit.args import KEY, require
from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.estimators import activation_bytes
from soma_pl.lit.plateau import PlateauConfig, steps_with_gradient
from soma_pl.lit.zo import check_full_precision
from soma_pl.models.gru import LAYERS, MATRICES, GRUStack
from soma_pl.models.stacked import LowRank


@dataclass(frozen=True)
class GRUShape:
    """The GRU model's shape (App. I.1)."""

    width: int = 339
    """d (the paper's reproduction: 20, 29, 58, 118, 339; 339 is 8,456,355 parameters)."""
    num_layers: int = LAYERS
    """L: GRU + MLP layers (the reference: 6)."""
    time_chunk: int = 128
    """Time steps held at once in the forward (bounds activation memory; not a model setting)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            require(getattr(self, f.name) >= 1, f"{KEY}.shape.{f.name}", getattr(self, f.name), ">= 1")


@dataclass(frozen=True)
class GRURecipe:
    """EGGROLL's settings in the GRU recipe (`model.init_args.recipe`; nano-egg's names in brackets)."""

    population: int = 2**20
    """N members per update, both signs of N / 2 antithetic pairs (the paper: 2^20)."""
    group_size: int = 4096
    """Members reading one stream; N / group_size streams per update (the paper: batch 256)."""
    rank: int = 1
    """r of every matrix perturbation (the paper: 1)."""
    sigma_shift: int = 4
    """The noise scale is 2^-sigma_shift (`sigma_shift`; the paper: 4, σ = 1/16)."""
    alpha: float = 0.01
    """Level of each coordinate's vote test (`alpha`; the paper: 0.01)."""
    stream_bytes: int = 100
    """Bytes of each stream per update (`tokens_per_update`; the paper: 100)."""
    max_members: int | None = None
    """Most members one loss call evaluates (bounds memory); None: a rank's whole share at once."""

    key: ClassVar[str] = f"{KEY}.recipe"

    def __post_init__(self) -> None:
        key = self.key
        require(self.population >= self.group_size, f"{key}.population", self.population,
                f"a multiple of {key}.group_size={self.group_size}")
        require(self.sigma_shift >= 0, f"{key}.sigma_shift", self.sigma_shift, ">= 0")
        require(0 < self.alpha < 1, f"{key}.alpha", self.alpha, "in (0, 1)")
        require(1 <= self.stream_bytes < WINDOW_BYTES - 1, f"{key}.stream_bytes", self.stream_bytes,
                f"in [1, {WINDOW_BYTES - 2}]")
        self.noise  # noqa: B018  (its own checks: group_size, population, rank, max_members under this key)

    @property
    def streams(self) -> int:
        """B: windows (streams) per batch."""
        return self.population // self.group_size

    @cached_property
    def noise(self) -> EGGROLLConfig:
        """The perturbations' settings: σ = 2^-sigma_shift, rank r, chunks of `max_members`."""
        return _RecipeNoise(sigma=2.0**-self.sigma_shift, rank=self.rank, population=self.population,
                            group_size=self.group_size, max_members=self.max_members)


@dataclass(frozen=True)
class _RecipeNoise(EGGROLLConfig):
    """EGGROLL's noise settings, checked under the recipe's key."""

    key: ClassVar[str] = GRURecipe.key


class GRUModule(ByteLMModule):
    """EGGROLL's GRU language-model recipe (App. I.1): streams with carried state, votes, a fixed step.

    Args:
        shape: the GRU model's width, layers and forward chunking.
        recipe: population, streams, rank, noise scale, vote level, bytes per update.
        optimizer: plain SGD (no momentum or weight decay), whose learning rate is the step size
            (the reference's `float_at_step`; the paper: 0.01).
        plateau: the step's decay on the expert-validation split (the reference holds it: configs set
            a patience no run reaches).
        seed: seed of the perturbations (regenerated from seed, step, pair).
        score_from: first target position scored in evaluation (the paper: 256).
    """

    shape_type = GRUShape

    def __init__(self, shape: GRUShape = GRUShape(), recipe: GRURecipe = GRURecipe(),
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau: PlateauConfig = PlateauConfig(),
                 seed: int = 0, score_from: int = ROUTE_BYTES):
        stream_bytes = (recipe.get("stream_bytes", GRURecipe.stream_bytes) if isinstance(recipe, dict)
                        else recipe.stream_bytes)
        super().__init__(num_experts=1, shape=shape, train_context=stream_bytes, score_from=score_from,
                         optimizer=optimizer, plateau=plateau, top_k=1)
        self.recipe = self.arg_group(GRURecipe, recipe, "recipe")
        self.seed = seed
        self.members = range(self.recipe.population)
        """The members this process evaluates (a rank's share of the pairs on several processes)."""
        self.windows: Tensor | None = None
        """`[1, B, 1025]` the windows the streams are reading; None before the first update."""
        self.cursor = 0
        """Bytes of `windows` the streams have read."""
        self.states: list[Tensor] = []
        """Each layer's h of every member of `members`, `[1, M, d]`, carried from segment to segment."""

    def build_model(self, num_experts: int) -> GRUStack:
        return GRUStack(num_experts, self.shape.width, self.shape.num_layers, self.shape.time_chunk)

    @property
    def method(self) -> str:
        return "eggroll"

    @property
    def rank_split(self) -> RankSplit:
        """Every rank reads the one stream of batches and evaluates its share of the members."""
        return RankSplit.replicated

    def setup(self, stage: str) -> None:
        check_full_precision(self)
        world, pairs = self.trainer.world_size, self.recipe.population // 2
        if stage == "fit" and pairs % world:
            raise ConfigError(f"{self.recipe.key}.population={self.recipe.population}: {world} processes must "
                              f"share its {pairs} antithetic pairs equally")
        share = rank_share(pairs, self.trainer.global_rank, world)
        self.members = range(2 * share.start, 2 * share.stop)
        super().setup(stage)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not steps_with_gradient(optimizer):
            raise ConfigError(f"{KEY}.optimizer={type(optimizer).__name__}: the recipe moves each voted coordinate "
                              f"by the learning rate, which only plain SGD (no momentum, weight decay or "
                              f"maximize) steps")
        return optimizer

    def next_segment(self, batch: Tensor) -> Tensor:
        """The streams' next `stream_bytes + 1` bytes, `[1, B, stream_bytes + 1]`: from the windows
        being read, or from `batch` (the states back at zero) once they are used up."""
        streams = self.recipe.streams
        if batch.dim() != 3 or batch.shape[:2] != (1, streams):
            raise ConfigError(f"training batch of shape {tuple(batch.shape)}: {self.recipe.key}.population="
                              f"{self.recipe.population} in groups of {self.recipe.group_size} needs "
                              f"data.init_args.batch_size={streams}")
        length = self.recipe.stream_bytes
        if self.windows_used_up():
            self.windows, self.cursor = batch.clone(), 0
            params = dict(self.model.named_parameters())
            self.states = [h.detach() for h in self.model.zero_state(params, len(self.members))]
        # where a checkpoint restored them before the model reached its device
        self.windows = self.windows.to(batch.device)
        self.states = [h.to(batch.device) for h in self.states]
        segment = self.windows[:, :, self.cursor : self.cursor + length + 1]
        self.cursor += length
        return segment

    def windows_used_up(self) -> bool:
        """Whether the next update takes new windows (its states back at zero)."""
        return self.windows is None or self.cursor + self.recipe.stream_bytes + 1 > self.windows.shape[2]

    def perturbed(self, device: torch.device) -> tuple[dict[str, torch.nn.Parameter], list[str], Tensor]:
        """What the noise is regenerated for: every weight, the names of the matrices among them (rank-r
        noise), and the one model's expert index."""
        params = self.trainable_parameters()
        return params, [name for name in params if name in MATRICES], torch.zeros(1, dtype=torch.long, device=device)

    @torch.no_grad()
    def member_losses(self, segment: Tensor) -> Tensor:
        """Every member's mean cross entropy on its stream's segment, `[1, N]` (this rank's share
        evaluated, the others' gathered), each chunk of members carrying its states on."""
        config = self.recipe.noise
        params, matrices, ids = self.perturbed(segment.device)
        losses = []
        for members in member_chunks(config, self.members):
            noise = chunk_noise(params, matrices, config, self.global_step, self.seed, ids, members)
            local = members - self.members.start
            state = [h[:, local] for h in self.states]
            tokens = segment[:, (members // config.group_size).to(segment.device)]
            losses.append(self.model.window_losses(tokens, noise=LowRank(len(members), noise.factors, noise.offsets),
                                                   state=state))
            for h, carried in zip(self.states, state, strict=True):
                h[:, local] = carried
        local_losses = torch.cat(losses, dim=1)
        if len(self.members) == self.recipe.population:
            return local_losses
        return self.all_gather(local_losses).permute(1, 0, 2).reshape(1, -1)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        segment = self.next_segment(batch)
        step = self.global_step
        clock = UpdateClock(segment.device)
        clock.start()
        losses = self.member_losses(segment)
        params, matrices, ids = self.perturbed(segment.device)
        step_direction = sign_test_step(params, matrices, losses, self.recipe.alpha, self.recipe.noise, step,
                                        self.seed, ids)
        for name, param in params.items():
            param.grad = step_direction[name]
        self.step_optimizer()
        clock.stop()
        self.check_finite(step, losses.mean(1))
        moved = sum(grad.count_nonzero() for grad in step_direction.values())
        evaluated = len(self.members) * (segment.shape[2] - 1)
        self.log_update(losses.mean(1), clock.seconds(), evaluated, sigma=self.recipe.noise.sigma,
                        moved=moved / sum(param.numel() for param in params.values()))

    def update_memory(self) -> UpdateMemory:
        """A loss call's members' activations over a time chunk."""
        rows = self.recipe.noise.chunk if self.recipe.max_members else len(self.members)
        return UpdateMemory(activation_bytes(self, rows), f"the activations of {rows} members per loss call",
                            f"{self.recipe.key}.max_members={self.recipe.max_members}")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Mid-window, the streams' windows, cursor and every member's carried state (gathered from the
        ranks: at paper scale 6 × 2^20 × 339 floats, 8.5 GB); nothing where the next update takes new
        windows, as at every validation of a run whose `val_check_interval` is a multiple of the
        updates per window (10: the configs' are)."""
        if self.windows_used_up():
            checkpoint["streams"] = {"windows": None, "cursor": 0, "states": []}
        else:
            states = [h if self.trainer.world_size == 1 else self.all_gather(h).permute(1, 0, 2, 3).flatten(1, 2)
                      for h in self.states]
            checkpoint["streams"] = {"windows": self.windows, "cursor": self.cursor, "states": states}
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        streams = checkpoint.get("streams") or {}
        self.windows, self.cursor = streams.get("windows"), streams.get("cursor", 0)
        self.states = [h[:, self.members.start : self.members.stop].clone() for h in streams.get("states", [])]
