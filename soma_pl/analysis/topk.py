"""`analyze topk`: ensemble-validation loss against k = 1..N from one pass (Fig. 16).

Every expert scores every window once; the router (saved inside SOMA checkpoints) orders the
experts per window from its first 256 bytes and :func:`soma_pl.eval.ensemble.score_windows` gives
the loss of the average of the top-k experts' probabilities for every k at once.

Output (JSON): ``k`` (1..N), ``loss_by_k`` (mean nats/byte over windows), ``loss_by_k_stderr`` and
``loss_by_k_bootstrap_95`` (document bootstrap), ``best_k``, ``expert_losses`` (each expert alone on
every window), ``routed_top1_share`` (how often each expert is ranked first), ``windows``,
``documents``, ``checkpoint``; per window, ``window_loss_by_k`` (``[windows][k]``) and its ``doc_ids``,
so a difference between two k can be bootstrapped over documents.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from soma_pl import ROUTE_BYTES
from soma_pl.analysis.loading import ensemble_val_windows, load_experts, load_router
from soma_pl.eval.bootstrap import document_bootstrap
from soma_pl.eval.checks import check_counts, check_finite
from soma_pl.eval.ensemble import EnsembleScores, score_windows
from soma_pl.io import check_apart, emit_json
from soma_pl.models.router import Router
from soma_pl.models.stacked import StackedExperts


@torch.no_grad()
def score_all(model: StackedExperts, router: Router, windows: torch.Tensor, batch_size: int,
              progress: bool = False) -> EnsembleScores:
    """Every top-k loss of every window, in batches (`progress`: a bar of batches on stderr).

    Args:
        windows: ``[n, 1025] uint8``.

    Returns:
        Scores with ``loss_by_k [n, E]``, ``expert_losses [E, n]``, ``ranking [n, E]``.
    """
    parts = []
    for chunk in tqdm(windows.split(batch_size), desc="analyze topk", unit="batch", disable=not progress):
        ranking = router.ranking(chunk[:, :ROUTE_BYTES])
        parts.append(score_windows(model, ranking, chunk, model.num_experts, ROUTE_BYTES))
    return EnsembleScores(torch.cat([p.loss_by_k for p in parts]), torch.cat([p.expert_losses for p in parts], 1),
                          torch.cat([p.ranking for p in parts]))


def topk_curve(scores: EnsembleScores, doc_ids) -> dict:
    """Summarise per-window scores into the Fig. 16 curve (see the module docstring)."""
    by_k = scores.loss_by_k.double()
    windows, experts = by_k.shape
    intervals = [document_bootstrap(by_k[:, k].numpy(), doc_ids) for k in range(experts)]
    mean = by_k.mean(0)
    stderr = by_k.std(0) / windows**0.5 if windows > 1 else torch.zeros_like(mean)
    first = torch.bincount(scores.ranking[:, 0], minlength=experts).double() / windows
    return {"k": list(range(1, experts + 1)), "loss_by_k": mean.tolist(), "loss_by_k_stderr": stderr.tolist(),
            "loss_by_k_bootstrap_95": [[i.low, i.high] for i in intervals], "best_k": int(mean.argmin()) + 1,
            "expert_losses": scores.expert_losses.double().mean(1).tolist(), "routed_top1_share": first.tolist(),
            "windows": windows, "documents": intervals[0].documents,
            "window_loss_by_k": by_k.tolist(), "doc_ids": [str(d) for d in doc_ids]}


def main(checkpoint: str, data: str = "data/demo", router: str | None = None, max_windows: int | None = None,
         batch_size: int = 16, out: str = "topk.json", progress: bool = True) -> None:
    """Fig. 16: ensemble-validation loss for every top-k from one pass.

    Args:
        checkpoint: a SOMA checkpoint (router inside).
        data: prepared dataset folder (its ensemble_val.npz is scored): the one the checkpoint was trained on.
        router: a router.pt replacing the checkpoint's, of the sharding the checkpoint was trained on.
        max_windows: score only the first windows; None: all of them.
        batch_size: windows per forward.
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    check_counts("analyze topk", max_windows=max_windows, batch_size=batch_size)
    check_apart(out, "--out", [checkpoint, data, router])
    loaded = load_experts(checkpoint)
    ranker = load_router(loaded, router)
    evalset = ensemble_val_windows(data, max_windows, loaded)
    scores = score_all(loaded.model, ranker, torch.from_numpy(evalset.windows.copy()), batch_size, progress=progress)
    check_finite("the top-k losses", scores.loss_by_k, f"checkpoint {loaded.path}")
    result = {"analysis": "topk", "figure": "Fig. 16", "checkpoint": loaded.path,
              "data": f"{data}/ensemble_val.npz", **topk_curve(scores, evalset.doc_ids)}
    emit_json(result, out)
