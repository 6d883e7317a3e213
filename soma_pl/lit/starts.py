"""How a fit starts and how its tied head learns, shared by the zero-order and BPTT modules (Fig. 9's
conditions): from a seed model or random weights (`Init`), and the head trained with the body,
by the decoder-path delta rule, or frozen (`HeadTraining`).
"""

from __future__ import annotations

from enum import Enum

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from soma_pl.errors import ConfigError
from soma_pl.estimators.delta_rule import decoder_gradient
from soma_pl.lit.args import KEY
from soma_pl.models.checkpoints import monolithic_state
from soma_pl.models.stacked import HeadMode, StackedExperts


class Init(str, Enum):
    """Where a fresh fit starts (Fig. 9); every side of a comparison starts the same way."""

    seed = "seed"
    """From a seed model of the same width: every expert a copy of it (the paper's warm start)."""
    random = "random"
    """From the module's random initialisation (`seed_everything`)."""


def start_checkpoint(init: Init | str | None, checkpoint: str | None) -> str | None:
    """The checkpoint a fresh fit starts from: `checkpoint` under `init: seed`, None under `random`.

    `init` None (unset) is `seed` when a checkpoint is given, else `random`.

    Raises:
        ConfigError: `init: seed` without a checkpoint, naming `seed_checkpoint`.
    """
    init = (Init.seed if checkpoint else Init.random) if init is None else Init(init)
    if init is Init.seed and checkpoint is None:
        raise ConfigError(f"init: seed needs {KEY}.seed_checkpoint (or set init: random)")
    if init is Init.random and checkpoint is not None:
        # A config's seed checkpoint overridden by `--model.init_args.init=random` (Fig. 9's ablation).
        rank_zero_warn(f"init: random: {KEY}.seed_checkpoint={checkpoint} is not used; the fit starts from "
                       "random weights")
    return checkpoint if init is Init.seed else None


class HeadTraining(str, Enum):
    """How the tied byte embedding / output head is trained (Fig. 9 ablations)."""

    trainable = "trainable"
    """Each expert's own head, perturbed and updated by its estimator."""
    decoder_only = "decoder_only"
    """Each expert's own head, stepped by the decoder-path delta rule (Eq. 7, App. E: its exact
    gradient through the decoder, the hidden states held fixed) with the body's optimizer; a
    zero-order module never perturbs it, BPTT does not differentiate it through the input embedding."""
    frozen_shared = "frozen_shared"
    """One head shared by all experts, frozen at the seed's values (the width-32 configs', N = 256 among them)."""
    frozen_random = "frozen_random"
    """One shared head frozen at random values."""


def head_mode(head_training: HeadTraining) -> HeadMode:
    """A frozen head is one head shared by the experts; a trained one is each expert's own."""
    frozen = HeadTraining(head_training) in (HeadTraining.frozen_shared, HeadTraining.frozen_random)
    return HeadMode.shared if frozen else HeadMode.per_expert


@torch.no_grad()
def warm_start(model: StackedExperts, path: str, head_training: HeadTraining,
               data: dict[str, tuple[str | None, str]] | None = None) -> None:
    """Copy the seed model at `path` into every expert of `model` (and into the shared head, unless
    it is random). A seed trained on other data than `data` (the data module's `data_in_use`) is
    refused, as `--ckpt_path` refuses such a checkpoint.

    Raises:
        ConfigError: the seed lacks a tensor or has another width, naming the tensor.
    """
    state, _ = monolithic_state(path, data)
    for name, param in model.named_parameters():
        if name == "head" and head_training is HeadTraining.frozen_random:
            continue
        if name not in state:
            raise ConfigError(f"seed checkpoint {path}: no '{name}'")
        source = state[name]
        one = source if name == "head" and source.dim() == 2 else source[0]  # one expert's tensor
        wanted = param.shape if model.is_shared(name) else param.shape[1:]
        if one.shape != wanted:
            raise ConfigError(f"seed checkpoint {path}: '{name}' has shape {list(one.shape)} per expert, "
                              f"the configured experts have {list(wanted)}")
        param.copy_(one if model.is_shared(name) else one.expand_as(param))


@torch.no_grad()
def head_gradient(model: StackedExperts, tokens: Tensor) -> Tensor:
    """Eq. 7's decoder-path gradient of every expert's head on `tokens [E, B, T]`, mean over the B
    windows and T − 1 targets, as the body's loss: one forward without gradients, span by span (each
    span's mean weighted by its share of the targets). Returns `[E, 256, d_E]`."""
    params = dict(model.named_parameters())
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    gradient, start = torch.zeros_like(model.head), 0
    for features in model.features(params, inputs):
        stop = start + features.shape[2]
        gradient.add_(decoder_gradient(features, params["head"], targets[..., start:stop]),
                      alpha=features.shape[2] / inputs.shape[2])
        start = stop
    return gradient
