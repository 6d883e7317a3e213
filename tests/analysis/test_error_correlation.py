"""`analyze error-correlation`: pair statistics against direct per-token computations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from soma_pl.analysis.error_correlation import DifficultyBaseline, bin_pairs
from soma_pl.cli import main
from tests.analysis.conftest import save_checkpoint, tiny_experts
from tests.analysis.test_topk import _target_probs, _windows


@pytest.mark.parametrize("baseline", list(DifficultyBaseline))
def test_pairs_match_direct_per_token_computation(tmp_path, prepared, baseline):
    model = tiny_experts(4, seed=1)
    path = save_checkpoint(tmp_path / "four.ckpt", model, None)
    out = tmp_path / "corr.json"
    main(["analyze", "error-correlation", "--checkpoint", str(path), "--data", str(prepared), "--bins", "2",
          "--baseline", baseline.value, "--batch_size", "4", "--out", str(out)])
    result = json.loads(out.read_text())
    probs = _target_probs(model, _windows(prepared)).reshape(4, -1)  # [E, tokens]
    losses = -probs.log()
    assert result["tokens"] == losses.shape[1] == 6 * 768
    assert len(result["pairs"]) == 6
    for pair in result["pairs"]:
        i, j = pair["experts"]
        others = [e for e in range(4) if baseline is DifficultyBaseline.all_experts or e not in (i, j)]
        shared = losses[others].mean(0)
        expected = np.corrcoef((losses[i] - shared).numpy(), (losses[j] - shared).numpy())[0, 1]
        assert pair["correlation"] == pytest.approx(expected, abs=1e-6)
        mixed = -((probs[i] + probs[j]) / 2).log()
        gain = float((losses[i] + losses[j]).mean() / 2 - mixed.mean())
        assert pair["gain"] == pytest.approx(gain, abs=1e-5)
        # Jensen, token by token: the mixture's loss never exceeds the mean of the two losses.
        assert bool(((losses[i] + losses[j]) / 2 - mixed >= -1e-12).all()) and pair["gain"] >= 0
    assert sum(b["pairs"] for b in result["bins"]) == 6


def test_bins_hold_equal_counts_in_correlation_order():
    correlation = torch.tensor([0.5, -0.2, 0.9, 0.1, 0.3, -0.6, 0.7])
    gain = torch.tensor([5.0, 2.0, 9.0, 1.0, 3.0, 0.0, 7.0])
    bins = bin_pairs(correlation, gain, 3)
    assert [b["pairs"] for b in bins] == [3, 2, 2]
    assert bins[0]["correlation"] == pytest.approx((-0.6 - 0.2 + 0.1) / 3)
    assert bins[0]["gain"] == pytest.approx(1.0) and bins[0]["correlation_range"] == pytest.approx([-0.6, 0.1])
    assert bins[2]["gain"] == pytest.approx(8.0) and bins[2]["gain_stderr"] == pytest.approx(1.0)
    assert [b["pairs"] for b in bin_pairs(correlation, gain, 20)] == [1] * 7


def test_two_experts_are_refused_in_one_line(tmp_path, prepared, capsys):
    path = save_checkpoint(tmp_path / "two.ckpt", tiny_experts(2), None)
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "error-correlation", "--checkpoint", str(path), "--data", str(prepared)])
    assert exit_info.value.code == 2
    assert "at least 3" in capsys.readouterr().err
