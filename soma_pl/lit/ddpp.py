"""DDPP: one monolithic model whose perturbations and micro-batches are shared out across ranks.

The paper's DDPP baseline (Fig. 12). Every rank reads the same global batch `[1, B, T]`; the step's
`(B / micro_batch) · n_pert` directions (direction `m · n_pert + k` reads micro-batch m) are dealt
out in contiguous shares and each rank evaluates its share. Then, by `exchange`:

- `estimates` (what Fig. 12 draws; the DDPP configs' choice): each rank sums its own directions'
  terms chunk by chunk as one process does, the coordinator (rank 0) adds the ranks' sums in rank
  order and sends the sum back. d floats up and d back per rank per step.
- `scalars`, the cheaper option: the ranks all-gather each direction's loss difference δ and mean
  loss (8 bytes per direction in float32), and every rank regenerates every direction from
  `(seed, step, direction)`, assembles the whole estimate in the same order and applies the same
  update. A few floats per step instead of a gradient.

Either way all ranks hold identical weights without exchanging any, and a run on W ranks reaches
the weights of monolithic SPSA on one process with the same global batch and chunks: `scalars` bit
for bit, `estimates` bit for bit when every rank's share is one whole chunk (`spsa.max_rows` sets
the chunk) and to float rounding otherwise.

It is a setting of the SPSA estimator, `model.init_args.spsa.exchange` (`ZOModule`, one expert):
run with `--trainer.strategy=ddp` and any `devices` / `num_nodes`; on one process both exchanges
are monolithic SPSA exactly. `data.batch_size` is the global batch B of a step (every rank reads
it); `n_pert` and `micro_batch` are as without the exchange, so the estimator does not depend on
the number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

import lightning as L
import torch
from torch import Tensor

from soma_pl.distributed import rank_share
from soma_pl.estimators.spsa import SPSAConfig, SPSAResult, assemble_estimate, estimate_sum, spsa_differences
from soma_pl.lit.parallel import coordinator_bytes, gather_bytes, gather_shares, sum_at_coordinator


class Exchange(str, Enum):
    """What DDPP ranks exchange each step (member names are what configs write)."""

    scalars = "scalars"
    """Each direction's δ and mean loss, all-gathered; every rank rebuilds the whole estimate."""
    estimates = "estimates"
    """Each rank's partial estimate (d floats) summed at rank 0 and sent back, as in Fig. 12."""


def step_exchange_bytes(exchange: Exchange, direction_count: int, parameter_count: int, experts: int,
                        dtype: torch.dtype, world: int) -> int:
    """Bytes one step's exchange delivers to (or, for `estimates`, moves for) each rank.

    With element size s (4 for float32), n = `direction_count` = (B / micro_batch) · n_pert and W
    ranks:
    - `scalars`: the all-gather of 2·E floats (δ and mean loss) per direction, shares padded to
      ⌈n / W⌉: `W · ⌈n / W⌉ · 2 · E · s` (`gather_bytes`).
    - `estimates`: a rank sends its partial estimate of d = `parameter_count` floats (all experts'
      perturbed parameters: the trainable ones less a `decoder_only` head) plus E partial mean
      losses to the coordinator and receives the sum:
      `2 · (d + E) · s`, the way Fig. 12 counts it (one arrow up, one down per rank; the
      coordinator's own links carry W times that).
    Both are 0 on one process.
    """
    if Exchange(exchange) is Exchange.scalars:
        return gather_bytes(direction_count, (2, experts), dtype, world)
    return coordinator_bytes(parameter_count + experts, dtype, world)


@torch.no_grad()
def partial_estimate(params: Mapping[str, Tensor], delta: Tensor, config: SPSAConfig, step: int, seed: int,
                     share: range) -> Tensor:
    """One rank's share of the SPSA estimate, not yet divided by the step's directions:
    `Σ_{k ∈ share} δ_k · z_k`, accumulated chunk by chunk as the one-process estimate is
    (`soma_pl.estimators.spsa.estimate_sum`), flat.

    Added in rank order, the shares' sums are the one-process sum: bit for bit when every share is
    one whole chunk of the estimate (`spsa.max_rows` sets the chunk: the paper's 16 directions, and
    64 directions on 4 ranks or 256 on 16 share out one chunk each), to float rounding otherwise.

    Args:
        params: name → `[E, ...]` (only shapes, dtype and device are read); the flat vector lists
            them in dict order.
        delta: `[E, len(share)]` the δ of directions `share`, column j for direction `share[j]`.
        config: direction kind and chunking.
        share: the direction indices this rank evaluated.

    Returns:
        `[E, d]` with d the perturbed parameters of one expert.
    """
    gradient = estimate_sum(params, delta, config, step, seed, share)
    return torch.cat([g.reshape(g.shape[0], -1) for g in gradient.values()], dim=1)


def unflatten(flat: Tensor, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Split `[E, d]` into name → `[E, ...]` tensors shaped like `params` (dict order)."""
    sizes = [param[0].numel() for param in params.values()]
    pieces = flat.split(sizes, dim=1)
    return {name: piece.reshape(param.shape) for (name, param), piece in zip(params.items(), pieces, strict=False)}


def exchanged_estimate(module: L.LightningModule, tokens: Tensor, config: SPSAConfig,
                       exchange: Exchange) -> tuple[SPSAResult, int, int]:
    """This rank's share of the step's directions, then the whole estimate by `exchange`.

    Args:
        module: the LightningModule (`global_step`, `seed`, `perturbed_parameters`, `loss_fn`, its
            trainer's ranks).
        tokens: `[1, B, T]` the global batch (the same on every rank).
        config: the SPSA settings at this step's ε.

    Returns:
        The estimate (every rank the same), the directions this rank evaluated, and the bytes the
        exchange delivered to each rank (`step_exchange_bytes`).
    """
    params = module.perturbed_parameters()
    step, seed = module.global_step, module.seed
    total = tokens.shape[1] // config.micro_batch * config.n_pert
    world = module.trainer.world_size
    share = rank_share(total, module.trainer.global_rank, world)
    delta, loss = spsa_differences(module.loss_fn, params, tokens, config, step, seed, share)
    sent = step_exchange_bytes(exchange, total, sum(p.numel() for p in params.values()), tokens.shape[0],
                               delta.dtype, world)
    if exchange is Exchange.estimates and world > 1:
        # Fig. 12: partial estimates and mean losses summed at rank 0, the sums sent back to all. The
        # result's `projected` holds only this rank's δ (`[E, len(share)]`): no rank sees the others'.
        partial = partial_estimate(params, delta, config, step, seed, share)  # [E, d]
        payload = torch.cat([partial, loss.sum(1).to(partial.dtype)[:, None]], dim=1)  # [E, d + 1]
        combined = sum_at_coordinator(module, payload) / total
        return SPSAResult(unflatten(combined[:, :-1], params), combined[:, -1], delta, delta), len(share), sent
    local = torch.stack([delta, loss]).permute(2, 0, 1)  # [directions, 2, E]: one row per direction
    everyone = gather_shares(module, local, total).permute(1, 2, 0).contiguous()  # [2, E, total]
    gradient = assemble_estimate(params, everyone[0], config, step, seed)
    return SPSAResult(gradient, everyone[1].mean(1), everyone[0], everyone[0]), len(share), sent
