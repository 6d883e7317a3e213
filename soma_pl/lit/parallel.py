"""Collectives of the multi-process modules: DDPP's δ exchange, expert-parallel SOMA's gathers.

Work is dealt out in contiguous shares (`rank_share`: experts, or one step's direction indices).
`gather_shares` puts every rank's share back together in rank order, identically on every rank.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from soma_pl.data.stream import rank_share


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
    """Every rank's `local` summed at rank 0 (the coordinator) and the sum sent back to all ranks.

    A collective: all ranks call it with tensors of one shape. The broadcast makes the result the
    same bits on every rank, whatever order the reduction added in (DDPP's `estimates` exchange,
    Fig. 12).

    Args:
        module: the LightningModule whose strategy set up the process group.
        local: this rank's term; not changed.

    Returns:
        The sum, a new tensor (`local` itself on one process).
    """
    if module.trainer.world_size == 1:
        return local
    total = local.clone()
    torch.distributed.reduce(total, dst=0)
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
