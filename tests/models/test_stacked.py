"""StackedExperts: Table 2 counts, the block against plain torch.nn, batched forward vs per-expert
runs, autograd vs differences."""

import math

import pytest
import torch
import torch.nn.functional as F

from soma_pl import VOCAB_SIZE
from soma_pl.models import HeadMode, StackedExperts, table2_rows
from soma_pl.models.reference import TorchExpert

TABLE2 = {
    # N: (d_t, expert body params, ensemble params)
    1: (509, 8_325_713, 8_333_905),
    2: (361, 4_195_181, 8_406_746),
    8: (181, 1_060_841, 8_552_264),
    256: (32, 32_928, 8_437_760),
}


def _tokens(groups: int, batch: int, steps: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (groups, batch, steps)
    return torch.randint(0, VOCAB_SIZE, shape, generator=generator, dtype=torch.uint8)


def _model(experts: int, width: int, **kwargs) -> StackedExperts:
    torch.manual_seed(0)
    return StackedExperts(experts, width, **kwargs)


def test_table2_counts_exact():
    rows = table2_rows()
    assert [row["N"] for row in rows] == [1, 2, 8, 256]
    for row in rows:
        width, body, ensemble = TABLE2[row["N"]]
        assert row["d_t"] == width
        projections = 2 * 32 * width if width != 32 else 0
        assert row["expert_body_params"] == body == 32 * width**2 + 5 * width + projections
        assert row["ensemble_params"] == ensemble
        assert row["head_params_per_expert"] == 8192
        assert row["head_shared"] == (row["N"] == 256)


def test_parameter_names_split_head_and_body():
    shared = StackedExperts(4, 32, head=HeadMode.shared, device="meta")
    assert shared.head_parameter_names() == ("head",)
    assert set(shared.body_parameter_names()) == {"norm_gains", "w_ih", "w_hh", "mlp_in", "mlp_out"}
    assert "head" not in shared.expert_parameters()
    wide = StackedExperts(2, 40, device="meta")
    names = {"head", "in_proj", "out_proj", "norm_gains", "w_ih", "w_hh", "mlp_in", "mlp_out"}
    assert set(wide.expert_param_shapes()) == names
    shapes = wide.expert_param_shapes()
    assert (shapes["w_hh"], shapes["mlp_in"], shapes["mlp_out"], shapes["norm_gains"]) == (
        torch.Size([2, 160, 40]), torch.Size([2, 160, 40]), torch.Size([2, 40, 160]), torch.Size([5, 40]))


@pytest.mark.parametrize("kernel", ["python", "library", "native"])
@pytest.mark.parametrize(("width", "head"),
                         [(12, HeadMode.per_expert), (32, HeadMode.shared), (44, HeadMode.per_expert)])
def test_each_expert_gives_the_logits_of_plain_torch_nn_with_its_weights(width, head, kernel):
    """App. C's expert built from nn.LSTM (no bias), nn.Linear, GELU and nn.LayerNorm (no bias),
    loaded with each expert's weights: the same logits, on every kernel."""
    model = _model(3, width, head=head, time_chunk=16, kernel=kernel)
    with torch.no_grad():  # gains and a head away from their inits, so a misplaced one shows
        model.norm_gains.uniform_(0.5, 1.5)
        model.head.normal_(0, 0.5)
    tokens = _tokens(3, 2, 37)
    with torch.no_grad():
        logits = model(tokens)
        for expert in range(3):
            expected = TorchExpert.of(model, expert)(tokens[expert])
            torch.testing.assert_close(logits[expert], expected, rtol=1e-4, atol=2e-5)


def _single_expert(model: StackedExperts, expert: int) -> StackedExperts:
    """A one-expert model holding expert ``expert``'s weights."""
    alone = StackedExperts(1, model.width, model.embed_dim, model.num_layers, time_chunk=7)
    with torch.no_grad():
        for name, param in alone.named_parameters():
            own = getattr(model, name)
            param.copy_(own if model.is_shared(name) else own[expert : expert + 1])
    return alone


@pytest.mark.parametrize("width,head", [(12, HeadMode.per_expert), (32, HeadMode.shared)])
def test_batched_forward_matches_each_expert_alone(width, head):
    model = _model(3, width, head=head, time_chunk=5)
    tokens = _tokens(3, 2, 13)
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (3, 2, 13, VOCAB_SIZE)
        for expert in range(3):
            alone = _single_expert(model, expert)(tokens[expert : expert + 1])
            torch.testing.assert_close(logits[expert : expert + 1], alone, atol=1e-5, rtol=1e-5)


def test_every_window_starts_from_a_zero_state():
    """The LSTM state is reset for every window (§6, App. A): a window's loss is the same whatever
    window came before it, and equals that of the window run from explicit zero states, while the
    same bytes continued from the state after another window score differently."""
    model = _model(1, 12, time_chunk=4)
    first, second = _tokens(1, 1, 17, seed=1), _tokens(1, 1, 17, seed=2)
    with torch.no_grad():
        alone = model.window_losses(second)
        model.window_losses(first)  # a window before it, in an earlier call
        after = model.window_losses(second)
        beside = model.window_losses(torch.cat([first, second], dim=1))[:, 1:]  # a row of the same batch
        zeros = [(torch.zeros(1, 1, 12), torch.zeros(1, 1, 12)) for _ in range(model.num_layers)]
        zero = model.window_losses(second, state=zeros)
        carried = [(torch.zeros(1, 1, 12), torch.zeros(1, 1, 12)) for _ in range(model.num_layers)]
        model.window_losses(first, state=carried)  # leaves `carried` at the state after `first`
        continued = model.window_losses(second, state=carried)
    assert torch.equal(after, alone) and torch.equal(zero, alone)
    torch.testing.assert_close(beside, alone, atol=1e-6, rtol=1e-6)
    assert (continued - alone).abs().item() > 1e-4


def test_copy_dimension_matches_each_copy_separately():
    model = _model(2, 10, time_chunk=4)
    copies = 3
    torch.manual_seed(1)
    params = {}
    for name, param in model.expert_parameters().items():
        noise = 0.05 * torch.randn(2 * copies, *param.shape[1:])
        params[name] = param.detach().repeat_interleave(copies, 0) + noise
    tokens = _tokens(2 * copies, 2, 9)
    with torch.no_grad():
        logits = model.forward_with(params, tokens)
        for group in range(2 * copies):
            one = {name: p[group : group + 1] for name, p in params.items()}
            alone = _single_expert(model, group // copies)
            expected = alone.forward_with(one, tokens[group : group + 1])
            torch.testing.assert_close(logits[group : group + 1], expected, atol=1e-5, rtol=1e-5)


def test_missing_parameters_are_repeated_per_expert():
    model = _model(2, 8)
    tokens = _tokens(4, 1, 6)
    with torch.no_grad():
        partial = {"norm_gains": model.norm_gains.detach().repeat_interleave(2, 0)}
        expected = model(tokens[[0, 2]])
        logits = model.forward_with(partial, tokens)
    torch.testing.assert_close(logits[[0, 2]], expected)
    with pytest.raises(KeyError, match="unknown parameter"):
        model.forward_with({"bias": torch.zeros(2)}, tokens)


def test_loss_per_group_matches_cross_entropy_of_logits():
    model = _model(2, 8, time_chunk=3)
    tokens = _tokens(2, 3, 11)
    with torch.no_grad():
        logits = model(tokens)[:, :, :-1]
        for score_from in (0, 4):
            nll = F.cross_entropy(
                logits[:, :, score_from:].reshape(-1, VOCAB_SIZE),
                tokens[:, :, score_from + 1 :].reshape(-1).long(),
                reduction="none",
            )
            loss = model.loss_per_group({}, tokens, score_from=score_from)
            torch.testing.assert_close(loss, nll.view(2, -1).mean(1))
    assert abs(loss.mean().item() - math.log(VOCAB_SIZE)) < 0.1  # near-uniform at init


def test_flat_vector_round_trip():
    model = _model(2, 8)
    flat = model.flatten_experts()
    assert flat.shape == (2, sum(s.numel() for s in model.expert_param_shapes().values()))
    model.load_flat_experts(torch.zeros_like(flat))
    assert model.flatten_experts().abs().sum() == 0
    model.load_flat_experts(flat)
    torch.testing.assert_close(model.flatten_experts(), flat)


def test_autograd_matches_central_differences_float64():
    model = _model(2, 8, num_layers=2, time_chunk=3).double()
    tokens = _tokens(2, 2, 7)
    loss = model.loss_per_group({}, tokens).sum()
    loss.backward()
    generator = torch.Generator().manual_seed(3)
    step = 1e-6
    for name, param in model.named_parameters():
        for index in torch.randint(0, param.numel(), (4,), generator=generator).tolist():
            flat = param.data.view(-1)
            original = flat[index].item()
            with torch.no_grad():
                flat[index] = original + step
                plus = model.loss_per_group({}, tokens).sum().item()
                flat[index] = original - step
                minus = model.loss_per_group({}, tokens).sum().item()
                flat[index] = original
            numeric = (plus - minus) / (2 * step)
            analytic = param.grad.view(-1)[index].item()
            assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-8), name


def test_meta_device_allocates_nothing():
    model = StackedExperts(256, 32, head=HeadMode.shared, device="meta")
    assert all(p.is_meta for p in model.parameters())
