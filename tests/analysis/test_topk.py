"""`analyze topk`: the curve from one pass against direct computations from full logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from soma_pl import ROUTE_BYTES
from soma_pl.analysis.loading import load_experts
from soma_pl.cli import main
from tests.analysis.conftest import random_router, save_checkpoint, tiny_experts


@pytest.fixture
def soma_n8(tmp_path):
    model, router = tiny_experts(8), random_router(8)
    return save_checkpoint(tmp_path / "soma.ckpt", model, router), model, router


def _windows(prepared) -> torch.Tensor:
    return torch.from_numpy(np.load(prepared / "ensemble_val.npz")["windows"])


def _target_probs(model, windows) -> torch.Tensor:
    """``[E, b, targets]`` every expert's probability of each scored target, from full logits."""
    tokens = windows.long().unsqueeze(0).expand(model.num_experts, -1, -1)
    probs = torch.softmax(model(tokens[..., :-1]).double(), -1)
    picked = probs.gather(-1, tokens[..., 1:, None]).squeeze(-1)
    return picked[..., ROUTE_BYTES:]


def test_k1_is_the_top_ranked_expert_and_kN_the_full_average(tmp_path, prepared, soma_n8, capsys):
    path, model, router = soma_n8
    out = tmp_path / "topk.json"
    main(["analyze", "topk", "--checkpoint", str(path), "--data", str(prepared), "--batch_size", "4",
          "--out", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr()
    assert json.loads(printed.out) == result, "stdout holds the JSON only; progress goes to stderr"
    assert "analyze topk" in printed.err and "2/2" in printed.err  # 6 windows in batches of 4
    windows = _windows(prepared)
    probs = _target_probs(model, windows)  # [8, 6, 768]
    top = router.ranking(windows)[:, 0]
    top1 = -probs[top, torch.arange(len(windows))].log().mean(1)
    full = -probs.mean(0).log().mean(1)
    assert result["k"] == list(range(1, 9)) and result["windows"] == 6 and result["documents"] == 3
    assert result["loss_by_k"][0] == pytest.approx(float(top1.mean()), rel=1e-4)
    assert result["loss_by_k"][-1] == pytest.approx(float(full.mean()), rel=1e-4)
    own = -probs.log().mean(2).mean(1)
    assert result["expert_losses"] == pytest.approx(own.tolist(), rel=1e-4)
    assert sum(result["routed_top1_share"]) == pytest.approx(1.0)
    assert result["best_k"] == int(np.argmin(result["loss_by_k"])) + 1
    low, high = result["loss_by_k_bootstrap_95"][0]
    assert low <= result["loss_by_k"][0] <= high


def test_loader_rebuilds_the_checkpoint_model(soma_n8):
    path, model, _ = soma_n8
    loaded = load_experts(path)
    assert loaded.router is not None and loaded.router.num_experts == 8
    for name, param in model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], param)


def test_a_checkpoint_without_router_is_refused_in_one_line(tmp_path, prepared, capsys):
    path = save_checkpoint(tmp_path / "spsa.ckpt", tiny_experts(2), None)
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "topk", "--checkpoint", str(path), "--data", str(prepared), "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2
    assert "holds no router" in capsys.readouterr().err


def test_a_missing_checkpoint_is_refused_in_one_line(tmp_path, prepared, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "topk", "--checkpoint", str(tmp_path / "none.ckpt"), "--data", str(prepared)])
    assert exit_info.value.code == 2
    assert "checkpoint not found" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["topk", "--batch_size", "4"], ["error-correlation"]])
def test_an_ensemble_validation_file_other_than_the_manifests_is_refused_in_one_line(command, tmp_path, prepared,
                                                                                    soma_n8, capsys):
    """The analyses score the windows `prepare` recorded: a file whose sha256 differs from the
    manifest's (edited, or copied from another dataset) is refused before anything is scored."""
    from soma_pl.data.formats.evalsets import EvalSet

    tampered = EvalSet.load(prepared / "ensemble_val.npz")
    tampered.windows[0, :8] = 0
    tampered.save(prepared / "ensemble_val.npz")
    with pytest.raises(SystemExit) as exited:
        main(["analyze", *command, "--checkpoint", str(soma_n8[0]), "--data", str(prepared),
              "--out", str(tmp_path / "out.json")])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(prepared / "ensemble_val.npz") in line and not (tmp_path / "out.json").exists()
