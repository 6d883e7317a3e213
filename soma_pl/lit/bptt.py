"""`BPTTModule`: the backpropagation baseline, autograd through the whole training context.

With N > 1 experts (Table 5's BPTT N = 2, 8) it trains an ensemble exactly as SOMA does, with
backprop instead of SPSA: each expert on its own shard (`data.init_args.experts_dir`) with its own
loss, its learning rate decaying on its own expert-validation split, evaluated by the router on
the first 256 bytes and top-k probability averaging (the same scoring code as SOMA).

It starts and trains its head as the zero-order module does (`soma_pl.lit.starts`), so Fig. 9's BPTT
controls (App. D.1) vary one thing at a time: a warm start from a seed model (`init`,
`seed_checkpoint`) or random weights, and a head trained by backprop, by the decoder-path delta rule
(`decoder_only`: the gradient through the decoder alone, none through the input embedding) or
frozen (`frozen_random`, `frozen_shared`).
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.contracts import UpdateClock
from soma_pl.lit.args import ModelShape
from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.starts import HeadTraining, Init, head_gradient


class BPTTModule(ByteLMModule):
    """Backprop through time over `train_context` bytes (the paper: 1,024), Adam by default.

    Args:
        optimizer: the torch optimizer (Adam by default; set its lr in YAML).
        plateau: each expert's learning-rate decay when its own expert-validation loss plateaus
            (N = 1: the prepared dataset's held-out 1%).
        num_experts: N; each expert is trained on its own shard with its own loss.
        head_training: `trainable` (backprop through decoder and embedding), `decoder_only` (the
            delta rule, Eq. 7), `frozen_shared` (one head, the seed's) or `frozen_random`.
        init: `seed` (every expert a copy of `seed_checkpoint`) or `random`; None: `seed` when
            `seed_checkpoint` is given, else `random`.
        seed_checkpoint: a monolithic checkpoint of the same width. Ignored when resuming.
        router_path: with N > 1, the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
        top_k: with N > 1, experts averaged in evaluation (the paper: 4; capped at N).
        Other arguments: see `ByteLMModule`.
    """

    def __init__(self, num_experts: int = 1, shape: ModelShape = ModelShape(),
                 head_training: HeadTraining = HeadTraining.trainable, init: Init | None = None,
                 seed_checkpoint: str | None = None, optimizer: OptimizerCallable = torch.optim.Adam,
                 plateau: PlateauConfig = PlateauConfig(), train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, router_path: str | None = None, top_k: int = 4):
        super().__init__(num_experts=num_experts, shape=shape, head_training=head_training, init=init,
                         seed_checkpoint=seed_checkpoint, train_context=train_context, score_from=score_from,
                         optimizer=optimizer, plateau=plateau, router_path=router_path, top_k=top_k)

    @property
    def method(self) -> str:
        return "bptt"

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        step = self.global_step
        clock = UpdateClock(tokens.device)
        clock.start()
        losses = self.model.loss_per_group({}, tokens)  # [E]: each expert's own loss
        self.manual_backward(losses.sum())  # experts share no weight: each gets its own loss's gradient
        count, windows, length = tokens.shape
        forwards = count * windows * (length - 1)
        if self.head_training is HeadTraining.decoder_only:  # the decoder's share of the head's gradient
            self.model.head.grad = head_gradient(self.model, tokens)
            forwards *= 2  # its forward runs without the tape
        self.step_optimizer()
        clock.stop()
        self.check_finite(step, losses)  # the step's one host read
        self.log_update(losses, clock.seconds(), forwards)
