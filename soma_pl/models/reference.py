"""One expert built from plain `torch.nn` layers: what a researcher would write for App. C's expert
without soma_pl, and the peer its tests and benchmarks compare against (same weights, same logits).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from soma_pl import VOCAB_SIZE
from soma_pl.models.stacked import MLP_RATIO, NORM_EPS, NORMS_PER_BLOCK, StackedExperts


class TorchBlock(nn.Module):
    """A pre-norm residual block: ``x + LSTM(LN(x))``, then ``x + W_out·GELU(W_in·LN(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lstm_norm = nn.LayerNorm(width, eps=NORM_EPS, bias=False)
        self.lstm = nn.LSTM(width, width, bias=False, batch_first=True)
        self.mlp_norm = nn.LayerNorm(width, eps=NORM_EPS, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, MLP_RATIO * width, bias=False), nn.GELU(),
                                 nn.Linear(MLP_RATIO * width, width, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.lstm(self.lstm_norm(x))[0]
        return x + self.mlp(self.mlp_norm(x))


class TorchExpert(nn.Module):
    """App. C's expert in `torch.nn`: tied embedding / head, projections when d_t ≠ d_E, blocks, final norm.

    Args:
        width, embed_dim, num_layers: d_t, d_E and D.
    """

    def __init__(self, width: int, embed_dim: int = 32, num_layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB_SIZE, embed_dim)
        self.in_proj = nn.Linear(embed_dim, width, bias=False) if width != embed_dim else nn.Identity()
        self.blocks = nn.ModuleList(TorchBlock(width) for _ in range(num_layers))
        self.norm = nn.LayerNorm(width, eps=NORM_EPS, bias=False)
        self.out_proj = nn.Linear(width, embed_dim, bias=False) if width != embed_dim else nn.Identity()

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens ``[b, T]`` → logits ``[b, T, 256]``."""
        x = self.in_proj(self.embedding(tokens.long()))
        for block in self.blocks:
            x = block(x)
        return self.out_proj(self.norm(x)) @ self.embedding.weight.t()

    @classmethod
    @torch.no_grad()
    def of(cls, model: StackedExperts, expert: int = 0) -> TorchExpert:
        """Expert ``expert`` of ``model`` with the same weights (the LSTM gates in the same order)."""
        own = {name: param if model.is_shared(name) else param[expert] for name, param in model.named_parameters()}
        built = cls(model.width, model.embed_dim, model.num_layers).to(own["w_ih"])
        built.embedding.weight.copy_(own["head"])
        if model.has_projections:
            built.in_proj.weight.copy_(own["in_proj"])
            built.out_proj.weight.copy_(own["out_proj"])
        for layer, block in enumerate(built.blocks):
            block.lstm_norm.weight.copy_(own["norm_gains"][NORMS_PER_BLOCK * layer])
            block.mlp_norm.weight.copy_(own["norm_gains"][NORMS_PER_BLOCK * layer + 1])
            block.lstm.weight_ih_l0.copy_(own["w_ih"][layer])
            block.lstm.weight_hh_l0.copy_(own["w_hh"][layer])
            block.mlp[0].weight.copy_(own["mlp_in"][layer])
            block.mlp[2].weight.copy_(own["mlp_out"][layer])
        built.norm.weight.copy_(own["norm_gains"][-1])
        for block in built.blocks:
            block.lstm.flatten_parameters()  # cuDNN wants one flat buffer
        return built

    def recurrent_gradients(self) -> Tensor:
        """The recurrent weights' gradients, ``[D, 4d, d]``."""
        return torch.stack([block.lstm.weight_hh_l0.grad for block in self.blocks])
