"""EGGROLL's GRU model against a plain `torch.nn` build of the same recipe loaded with the same weights.

`torch.nn.GRU` cannot be the reference: the recipe's cell (nano-egg's `EGG_GRU`) has one gate f, applied
to h before the candidate's recurrent matrix and used as the update gate, where `torch.nn.GRU` has a
reset gate applied after its recurrent product and a separate update gate. The reference here is the
cell written out with `nn.Linear` layers, and its size is the paper's: 8,456,355 at d = 339 ("≈ 8.44M"),
where a `torch.nn.GRU` body would hold 9.84M.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from soma_pl.models.gru import GRUStack, gru_parameter_count
from soma_pl.models.stacked import LowRank

WIDTH, LAYERS = 6, 2


class PlainGRULM(nn.Module):
    """The recipe from `torch.nn` parts, one time step at a time; `weights` in the reference's units
    (each matrix loaded as W/√fan_in into its `nn.Linear`)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        d, layers = weights["embed"].shape[-1], weights["w_ih"].shape[0]

        def linear(weight: torch.Tensor) -> nn.Linear:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight.data.copy_(weight / math.sqrt(weight.shape[1]))
            return layer

        self.embed = nn.Embedding(256, d)
        self.embed.weight.data.copy_(weights["embed"])
        self.w_f = nn.ModuleList(linear(weights["w_ih"][i, 0]) for i in range(layers))
        self.w_h = nn.ModuleList(linear(weights["w_ih"][i, 1]) for i in range(layers))
        self.u_f = nn.ModuleList(linear(weights["w_hh"][i, 0]) for i in range(layers))
        self.u_h = nn.ModuleList(linear(weights["w_hh"][i, 1]) for i in range(layers))
        self.b_f = [weights["bias"][i, 0] for i in range(layers)]
        self.b_h = [weights["bias"][i, 1] for i in range(layers)]
        self.mlps = nn.ModuleList(nn.Sequential(linear(weights["mlp_in"][i]), nn.ReLU(), linear(weights["mlp_out"][i]))
                                  for i in range(layers))
        self.gains = weights["norm_gains"]
        self.head = linear(weights["head"])

    def norm(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self.gains[index] * x / x.abs().mean(-1, keepdim=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, T] → logits [b, T, 256]
        x = self.embed(tokens.long())
        for i, mlp in enumerate(self.mlps):
            h = torch.zeros(x.shape[0], x.shape[-1])
            normed, outputs = self.norm(2 * i, x), []
            for t in range(x.shape[1]):
                f = torch.sigmoid(self.w_f[i](normed[:, t]) + self.u_f[i](h) + self.b_f[i])
                candidate = torch.tanh(self.w_h[i](normed[:, t]) + self.u_h[i](f * h) + self.b_h[i])
                h = (1 - f) * h + f * candidate
                outputs.append(h)
            x = x + torch.stack(outputs, dim=1)
            x = x + mlp(self.norm(2 * i + 1, x))
        return self.head(self.norm(2 * len(self.mlps), x))


def _model(seed: int = 0, time_chunk: int = 5) -> GRUStack:
    torch.manual_seed(seed)
    model = GRUStack(1, WIDTH, LAYERS, time_chunk=time_chunk)
    with torch.no_grad():  # biases and gains away from their initial zeros and ones
        model.bias.normal_(std=0.5)
        model.norm_gains.uniform_(0.5, 1.5)
    return model


def _tokens(rows: int, steps: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, rows, steps), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@torch.no_grad()
def test_logits_equal_the_plain_torch_nn_build_with_the_same_weights():
    model, tokens = _model(), _tokens(3, 17)  # 17 steps: time chunks of 5 cross the sequence
    plain = PlainGRULM({name: param[0] for name, param in model.named_parameters()})
    torch.testing.assert_close(model(tokens)[0], plain(tokens[0]), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_each_member_runs_its_own_perturbed_weights():
    model, members, rank = _model(), 3, 2
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(5)
    factors, offsets = {}, {}
    for name in ("embed", "w_ih", "w_hh", "mlp_in", "mlp_out", "head"):
        *stack, out, width = params[name].shape[1:]
        factors[name] = (0.1 * torch.randn(1, members, *stack, out, rank, generator=generator),
                         torch.randn(1, members, *stack, width, rank, generator=generator))
    for name in ("bias", "norm_gains"):
        offsets[name] = 0.1 * torch.randn(1, members, *params[name].shape[1:], generator=generator)
    tokens = _tokens(2 * members, 12)  # two windows per member
    losses = model.window_losses(tokens, noise=LowRank(members, factors, offsets))
    for m in range(members):
        weights = {name: param[0] for name, param in params.items()}
        for name, (a, b) in factors.items():
            weights[name] = weights[name] + a[0, m] @ b[0, m].transpose(-1, -2)
        for name, offset in offsets.items():
            weights[name] = weights[name] + offset[0, m]
        rows = tokens[0, 2 * m : 2 * m + 2]
        logits = PlainGRULM(weights)(rows[:, :-1])
        expected = nn.functional.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].long().reshape(-1),
                                               reduction="none").view(2, -1).mean(1)
        torch.testing.assert_close(losses[0, 2 * m : 2 * m + 2], expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_carried_state_continues_the_stream_as_one_pass():
    model, tokens, cut = _model(time_chunk=4), _tokens(2, 23), 9
    whole = torch.cat(list(model.target_log_probs({}, tokens)), dim=2)
    state = model.zero_state(dict(model.named_parameters()), 2)
    first = torch.cat(list(model.target_log_probs({}, tokens[..., : cut + 1], state=state)), dim=2)
    second = torch.cat(list(model.target_log_probs({}, tokens[..., cut:], state=state)), dim=2)
    torch.testing.assert_close(torch.cat((first, second), dim=2), whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [20, 29, 58, 118, 339])
def test_parameter_count_is_the_recipes(width):
    model = GRUStack(1, width, device="meta")
    count = sum(param.numel() for param in model.parameters())
    assert count == gru_parameter_count(width) == 72 * width**2 + 537 * width
    if width == 339:  # the paper's EGGROLL row is among its "approximately 8.44M-parameter" models
        assert count == 8_456_355 and abs(count / 8.44e6 - 1) < 0.005


@torch.no_grad()
def test_incremental_decoding_gives_the_full_forwards_logits():
    model, tokens = _model(time_chunk=4), _tokens(2, 11)
    whole = model(tokens)  # [1, 2, 11, 256]
    decoder = model.decoder(torch.tensor([0]), batch=2)
    steps = [decoder(tokens[..., :6])] + [decoder(tokens[..., t : t + 1]) for t in range(6, 11)]
    torch.testing.assert_close(torch.stack(steps, dim=2), whole[:, :, 5:], rtol=1e-5, atol=1e-5)
