"""`analyze error-correlation`: do pairs of experts that err differently gain more from averaging? (Fig. 17)

For every pair of experts (i, j), on all scored ensemble-validation tokens (the 768 targets after
the routed 256 bytes of each window):

- error similarity: the Pearson correlation over tokens of the two experts' per-token losses
  after removing shared token difficulty, i.e. after subtracting each token's mean loss over all
  experts (``all_experts``) or over the experts outside the pair (``other_experts``);
- averaging gain: the mean of the pair's losses minus the loss of their averaged probabilities,
  ``(ℓ_i + ℓ_j)/2 + log((p_i + p_j)/2)`` per token, in nats/byte. It is ≥ 0 token by token
  (Jensen: log is concave).

One pass accumulates each expert's loss sums, the experts' loss cross-products (so every pair's
residual correlation follows for any linear difficulty baseline) and each pair's averaged loss.
Pairs are then binned by correlation into bins of equal pair count.

Output (JSON): ``pairs`` (per pair: ``experts``, ``correlation``, ``gain``, ``losses``,
``pair_loss``), ``bins`` (``correlation``, ``correlation_range``, ``gain``, ``gain_stderr``,
``pairs``), ``gain_correlation_pearson``, ``tokens``, ``difficulty_baseline``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor
from tqdm import tqdm

from soma_pl import ROUTE_BYTES
from soma_pl.analysis.loading import ensemble_val_windows, load_experts
from soma_pl.errors import ConfigError
from soma_pl.eval.checks import check_counts, check_finite
from soma_pl.io import check_apart, emit_json
from soma_pl.models.stacked import StackedExperts

PAIR_CHUNK_ELEMENTS = 1 << 24
"""Most (pair, token) log-probabilities mixed at once."""


class DifficultyBaseline(str, Enum):
    """Which per-token mean loss is removed as shared token difficulty."""

    all_experts = "all_experts"
    """Mean over all N experts (the pair included; negligible for the paper's N = 256)."""
    other_experts = "other_experts"
    """Mean over the N − 2 experts outside the pair (unbiased by the pair itself for small N)."""


@dataclass
class PairStatistics:
    """Token sums of one pass, all in float64.

    Attributes:
        tokens: scored tokens n.
        loss_sums: ``[E]`` Σ_t ℓ_e(t).
        cross_sums: ``[E, E]`` Σ_t ℓ_e(t) ℓ_f(t).
        pair_loss_sums: ``[P]`` Σ_t −log((p_i + p_j)/2) for the pairs ``pairs [2, P]`` (i < j).
    """

    tokens: int
    loss_sums: Tensor
    cross_sums: Tensor
    pair_loss_sums: Tensor
    pairs: Tensor


@torch.no_grad()
def accumulate(model: StackedExperts, windows: Tensor, batch_size: int,
               score_from: int = ROUTE_BYTES, progress: bool = False) -> PairStatistics:
    """One pass of every expert over `windows: [n, T] uint8`, accumulating :class:`PairStatistics`
    (`progress`: a bar of batches on stderr)."""
    experts = model.num_experts
    pairs = torch.triu_indices(experts, experts, offset=1)
    float64 = {"dtype": torch.float64}
    stats = PairStatistics(0, torch.zeros(experts, **float64), torch.zeros(experts, experts, **float64),
                           torch.zeros(pairs.shape[1], **float64), pairs)
    for chunk in tqdm(windows.split(batch_size), desc="analyze error-correlation", unit="batch", disable=not progress):
        tokens = chunk.unsqueeze(0).expand(experts, *chunk.shape)
        for log_probs in model.target_log_probs({}, tokens, score_from):  # [E, b, Tc]
            flat = log_probs.reshape(experts, -1).double()
            stats.tokens += flat.shape[1]
            stats.loss_sums -= flat.sum(1)
            stats.cross_sums += flat @ flat.T  # (−ℓ_e)(−ℓ_f) = ℓ_e ℓ_f
            stats.pair_loss_sums += _pair_mixture_nats(flat, pairs)
    return stats


def _pair_mixture_nats(log_probs: Tensor, pairs: Tensor) -> Tensor:
    """Σ_t −log((p_i + p_j)/2) per pair. log_probs: ``[E, t]``; pairs: ``[2, P]`` → ``[P]``."""
    per_block = max(1, PAIR_CHUNK_ELEMENTS // max(1, log_probs.shape[1]))
    sums = []
    for first in range(0, pairs.shape[1], per_block):
        i, j = pairs[:, first : first + per_block]
        mixed = torch.logaddexp(log_probs[i], log_probs[j]) - math.log(2.0)
        sums.append(-mixed.sum(1))
    return torch.cat(sums) if sums else log_probs.new_zeros(0)


def residual_correlations(stats: PairStatistics, baseline: DifficultyBaseline) -> Tensor:
    """Each pair's correlation of per-token losses after removing shared difficulty: ``[P]``.

    The residual of expert i in pair (i, j) is ``ℓ_i − wᵀℓ`` for baseline weights w (uniform over
    all experts, or over the others), a linear map of the per-token losses, so its covariances
    follow from the loss covariance matrix.
    """
    experts = stats.loss_sums.numel()
    mean = stats.loss_sums / stats.tokens
    covariance = stats.cross_sums / stats.tokens - torch.outer(mean, mean)
    i, j = stats.pairs
    eye = torch.eye(experts, dtype=torch.float64)
    if DifficultyBaseline(baseline) is DifficultyBaseline.all_experts:
        shared = torch.full((i.numel(), experts), 1.0 / experts, dtype=torch.float64)
    else:
        shared = (1.0 - eye[i] - eye[j]) / (experts - 2)
    first, second = eye[i] - shared, eye[j] - shared  # [P, E] residual weights

    def cov(a: Tensor, b: Tensor) -> Tensor:
        return ((a @ covariance) * b).sum(1)

    return cov(first, second) / (cov(first, first) * cov(second, second)).clamp_min(1e-300).sqrt()


def bin_pairs(correlation: Tensor, gain: Tensor, bins: int) -> list[dict]:
    """Equal-count bins of pairs sorted by correlation (fewer bins when there are fewer pairs).

    Returns:
        Per bin: mean ``correlation``, its ``correlation_range``, mean ``gain`` with its standard
        error ``gain_stderr`` (0 for a single pair), and the number of ``pairs``.
    """
    order = torch.argsort(correlation)
    out = []
    for members in torch.tensor_split(order, min(bins, order.numel())):
        c, g = correlation[members].double(), gain[members].double()
        stderr = float(g.std() / len(g) ** 0.5) if len(g) > 1 else 0.0
        out.append({"correlation": float(c.mean()), "correlation_range": [float(c.min()), float(c.max())],
                    "gain": float(g.mean()), "gain_stderr": stderr, "pairs": len(g)})
    return out


def summarise(stats: PairStatistics, baseline: DifficultyBaseline, bins: int) -> dict:
    """The JSON body: per-pair points, bins and the across-pair Pearson correlation."""
    losses = stats.loss_sums / stats.tokens
    i, j = stats.pairs
    pair_loss = stats.pair_loss_sums / stats.tokens
    gain = (losses[i] + losses[j]) / 2 - pair_loss
    correlation = residual_correlations(stats, baseline)
    points = [{"experts": [int(a), int(b)], "correlation": float(c), "gain": float(g),
               "losses": [float(losses[a]), float(losses[b])], "pair_loss": float(p)}
              for a, b, c, g, p in zip(i, j, correlation, gain, pair_loss, strict=False)]
    spread = torch.corrcoef(torch.stack((correlation, gain)))[0, 1] if len(points) > 1 else torch.tensor(float("nan"))
    return {"difficulty_baseline": DifficultyBaseline(baseline).value, "tokens": stats.tokens,
            "experts": losses.numel(), "expert_losses": losses.tolist(), "pairs": points,
            "bins": bin_pairs(correlation, gain, bins), "gain_correlation_pearson": float(spread)}


def main(checkpoint: str, data: str = "data/demo", baseline: DifficultyBaseline = DifficultyBaseline.all_experts,
         bins: int = 10, max_windows: int | None = None, batch_size: int = 16, out: str = "error_correlation.json",
         progress: bool = True) -> None:
    """Fig. 17: pairwise error correlation against the gain of averaging.

    Args:
        checkpoint: a checkpoint of N >= 3 stacked experts.
        data: prepared dataset folder (its ensemble_val.npz is scored).
        baseline: the per-token mean removed as shared difficulty.
        bins: equal-count correlation bins.
        max_windows: use only the first windows; None: all of them.
        batch_size: windows per forward.
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    check_counts("analyze error-correlation", bins=bins, max_windows=max_windows, batch_size=batch_size)
    check_apart(out, "--out", [checkpoint, data])
    loaded = load_experts(checkpoint)
    if loaded.model.num_experts < 3:
        raise ConfigError(f"checkpoint {loaded.path} has {loaded.model.num_experts} experts; removing shared token "
                          "difficulty needs at least 3")
    evalset = ensemble_val_windows(data, max_windows, loaded)
    stats = accumulate(loaded.model, torch.from_numpy(evalset.windows.copy()), batch_size, progress=progress)
    check_finite("the expert losses", stats.loss_sums, f"checkpoint {loaded.path}")
    result = {"analysis": "error_correlation", "figure": "Fig. 17", "checkpoint": loaded.path,
              "data": f"{data}/ensemble_val.npz", **summarise(stats, baseline, bins)}
    emit_json(result, out)
