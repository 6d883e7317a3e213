"""Collectives of multi-process fitting: DDPP's δ exchange, and `ExpertParallel`, the
expert-parallel fitting of SOMA.

Work is dealt out in contiguous shares (`rank_share`: experts, or one step's direction indices).
`gather_shares` puts every rank's share back together in rank order, identically on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from soma_pl.distributed import RankSplit, rank_share
from soma_pl.errors import ConfigError
from soma_pl.eval.metrics import PerExpertNats
from soma_pl.models.recurrence import Kernel, cuda_choice
from soma_pl.models.stacked import StackedExperts


def gather_shares(module: L.LightningModule, local: Tensor, count: int) -> Tensor:
    """Concatenate every rank's share of `count` items along dim 0 (a collective: all ranks call it).

    Args:
        module: the LightningModule whose strategy gathers.
        local: `[len(rank_share(count, rank, W)), ...]` this rank's rows.
        count: items in all shares together.

    Returns:
        `[count, ...]`, rank 0's rows first. Shares differ in size by at most one; each is padded
        to the largest for the all-gather.
    """
    world = module.trainer.world_size
    if world == 1:
        return local
    largest = -(-count // world)
    padded = local.new_zeros(largest, *local.shape[1:])
    padded[: local.shape[0]] = local
    gathered = module.all_gather(padded)  # [W, largest, ...]
    return torch.cat([gathered[rank, : len(rank_share(count, rank, world))] for rank in range(world)])


def gather_bytes(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, world: int) -> int:
    """Bytes one `gather_shares` of `rows` items delivers to each rank (padding included)."""
    if world == 1:
        return 0
    per_rank = -(-rows // world) * torch.Size(row_shape).numel() * torch.empty((), dtype=dtype).element_size()
    return per_rank * world


def sum_at_coordinator(module: L.LightningModule, local: Tensor) -> Tensor:
    """Every rank's `local` sent to rank 0 (the coordinator), added there one by one in rank order,
    and the sum sent back to all ranks (DDPP's `estimates` exchange, Fig. 12).

    A collective: all ranks call it with tensors of one shape. Added in rank order to rank 0's own
    term, partial sums that each hold one chunk of a one-process accumulation give that
    accumulation's bits; the broadcast gives every rank the same bits. The coordinator holds two
    terms at a time, whatever the number of ranks.

    Args:
        module: the LightningModule whose strategy set up the process group.
        local: this rank's term; not changed.

    Returns:
        The sum, a new tensor (`local` itself on one process).
    """
    world = module.trainer.world_size
    if world == 1:
        return local
    if module.trainer.global_rank != 0:
        torch.distributed.send(local.contiguous(), dst=0)
        total = torch.empty_like(local)
    else:
        total, arriving = local.clone(), torch.empty_like(local)
        for rank in range(1, world):
            torch.distributed.recv(arriving, src=rank)
            total += arriving
    torch.distributed.broadcast(total, src=0)
    return total


def coordinator_bytes(values: int, dtype: torch.dtype, world: int) -> int:
    """Bytes one `sum_at_coordinator` of `values` elements moves per rank: its term up and the sum back."""
    if world == 1:
        return 0
    return 2 * values * torch.empty((), dtype=dtype).element_size()


def keep_buffers_local(module: torch.nn.Module) -> None:
    """Tell DDP not to broadcast `module`'s buffers from rank 0 before every forward.

    The modules keep their buffers identical on every rank themselves (they are only changed with
    gathered values), so the broadcast would be per-step traffic for nothing. Call before the
    strategy wraps the module (in `setup`).
    """
    names = [name for name, _ in module.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def gather_optimizer_state(module: L.LightningModule, state: dict, params: list[Tensor], count: int) -> dict:
    """An optimizer `state_dict` whose per-parameter tensors cover all `count` experts.

    Args:
        state: this rank's `optimizer.state_dict()` over `params` (each `[share, ...]`); not changed
            (its per-parameter dicts are the optimizer's own).
        params: the optimizer's parameters in order.

    Returns:
        A copy whose state tensors shaped like their parameter are gathered to `[count, ...]`.
    """
    gathered = dict(state, state={})
    for index, entry in state["state"].items():
        param = params[index]
        gathered["state"][index] = {
            key: gather_shares(module, value, count) if isinstance(value, Tensor) and value.shape == param.shape
            else value
            for key, value in entry.items()
        }
    return gathered


def slice_optimizer_state(state: dict, shapes: list[torch.Size], share: range) -> None:
    """In place: cut a gathered optimizer `state_dict` down to one rank's `share` of the experts.

    Args:
        shapes: each parameter's full `[count, ...]` shape, in the optimizer's order.
    """
    for index, entry in state["state"].items():
        for key, value in list(entry.items()):
            if isinstance(value, Tensor) and value.shape == shapes[index]:
                entry[key] = value[share.start : share.stop].clone()


@dataclass
class ExpertShare:
    """The experts one rank trains in expert-parallel mode."""

    experts: range
    """Global indices of the rank's experts (a contiguous `rank_share`)."""
    model: StackedExperts
    """Their weights, `[len(experts), ...]`, which the rank's optimizer steps."""


class ExpertParallel:
    """Expert-parallel fitting of a module's stacked experts: on W > 1 processes rank r owns a
    contiguous share of the experts, reads only their shards and trains them in a model of its own,
    with no per-step communication.

    Evaluation gathers every rank's experts into the full `model` first and all-gathers the
    per-expert validation losses, so every rank decays each expert's learning rate alike; a
    checkpoint gathers the experts and their optimizer state, so rank 0's holds every expert, as a
    one-process checkpoint does, and loading one slices it back to the rank's share.

    A plain object, not a submodule: DDP, `state_dict` and checkpoints see only the full `model`.
    """

    def __init__(self, module: L.LightningModule, enabled: bool = True):
        self.module = module
        """The host: a LightningModule with a `StackedExperts` `model`."""
        self.enabled = enabled
        """Whether the host shares its experts out (a model of one expert does not)."""
        self.share: ExpertShare | None = None
        """This rank's experts once fitting expert-parallel has begun; None on one process."""

    @property
    def active(self) -> bool:
        """Fitting on several processes: each owns a share of the experts."""
        trainer = self.module._trainer
        return self.enabled and trainer is not None and trainer.world_size > 1 and trainer.state.fn == "fit"

    @property
    def rank_split(self) -> RankSplit:
        """How ranks share the training data (read by the data module)."""
        return RankSplit.experts if self.active else RankSplit.documents

    @property
    def experts(self) -> range:
        """The experts this process trains: all of them, or its share."""
        return self.share.experts if self.share is not None else range(self.module.model.num_experts)

    @property
    def trained_model(self) -> StackedExperts:
        """The weights the optimizer steps: the full model, or this rank's share of it."""
        return self.share.model if self.share is not None else self.module.model

    def own_experts(self) -> range:
        """This rank's share of the experts."""
        trainer = self.module.trainer
        return rank_share(self.module.model.num_experts, trainer.global_rank, trainer.world_size)

    def check_world_size(self, world_size: int) -> None:
        """Every process needs at least one expert."""
        count = self.module.model.num_experts
        if world_size > count:
            raise ConfigError(f"expert-parallel {type(self.module).__name__} of {count} experts on {world_size} "
                              f"processes: each process needs at least one expert")

    def setup(self) -> None:
        """Each rank scores only its own experts' expert-validation windows (the losses are gathered),
        and keeps its buffers out of DDP's broadcast."""
        if self.active:
            self.module.expert_val_loss = PerExpertNats(len(self.own_experts()), sync_on_compute=False)
            keep_buffers_local(self.module)

    @torch.no_grad()
    def take_share(self) -> None:
        """Copy this rank's experts (shared head included) out of the full model into a model of its
        own (call after any checkpoint restore, when the full model holds the start weights)."""
        if not self.active:
            return
        experts, full = self.own_experts(), self.module.model
        # A one-expert share would run the library kernel where the full model runs the grouped one;
        # keeping the full model's choice keeps each expert's losses bit for bit those of one process.
        kernel = full.kernel
        if kernel is Kernel.auto and full.num_experts > 1:
            kernel = cuda_choice(full.width) if full.w_hh.is_cuda else Kernel.native
        own = StackedExperts(len(experts), full.width, full.embed_dim, full.num_layers, full.head_mode,
                             full.time_chunk, kernel=kernel, device=full.w_hh.device, dtype=full.w_hh.dtype)
        for (name, mine), theirs in zip(own.named_parameters(), full.parameters(), strict=True):
            mine.copy_(theirs if full.is_shared(name) else theirs[experts.start : experts.stop])
            mine.requires_grad_(theirs.requires_grad)
        self.share = ExpertShare(experts, own)

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every rank's experts into the full model (a collective: every rank calls it)."""
        if self.share is None:
            return
        full = dict(self.module.model.named_parameters())
        for name, param in self.share.model.expert_parameters().items():
            full[name].copy_(gather_shares(self.module, param.detach(), self.module.model.num_experts))

    def gather_losses(self, losses: Tensor) -> Tensor:
        """This process's experts' losses → all experts' `[E]`."""
        count = self.module.model.num_experts
        if self.share is None:
            return losses.reshape(count)
        # torchmetrics squeezes a one-expert share to a scalar
        return gather_shares(self.module, losses.reshape(len(self.share.experts)), count)

    def save(self, checkpoint: dict, params: list[Tensor]) -> None:
        """Put every expert and its optimizer state (over `params`, this rank's) into `checkpoint`
        (every rank calls it; rank 0 writes)."""
        if self.share is None:
            return
        self.gather_weights()
        model = self.module.model
        for name, param in model.expert_parameters().items():
            checkpoint["state_dict"][f"model.{name}"] = param.detach().clone()
        if "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [gather_optimizer_state(self.module, state, params, model.num_experts)
                                              for state in checkpoint["optimizer_states"]]

    def load(self, checkpoint: dict) -> None:
        """Keep only this rank's share of the checkpoint's optimizer state (it holds every expert's)."""
        if not self.active:
            return
        shapes = [p.shape for p in self.module.model.expert_parameters().values() if p.requires_grad]
        for state in checkpoint.get("optimizer_states", []):
            slice_optimizer_state(state, shapes, self.own_experts())
