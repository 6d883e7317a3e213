"""`evaluate` on external text, against independent computations; the routed top-k scoring path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.cli import main
from soma_pl.eval.ensemble import score_top_k, score_windows, slot_layout
from soma_pl.evaluate_text import DocumentSplit, read_windows
from soma_pl.lit import ZOModule
from soma_pl.models.router import HashedNgramEncoder, Router
from soma_pl.models.stacked import HeadMode, StackedExperts

TINY = {"shape": {"width": 8, "num_layers": 1, "embed_dim": 8, "time_chunk": 256}}


def _text(seed: int, size: int) -> bytes:
    rng = np.random.default_rng(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"river", b"stone", b"\n"]
    out = b" ".join(words[i] for i in rng.integers(0, len(words), size))
    return out[:size]


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "text"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(_text(0, 3 * WINDOW_BYTES + 100))  # 3 windows, tail dropped
    (folder / "sub" / "b.md").write_bytes(_text(1, 2 * WINDOW_BYTES))  # 2 windows
    (folder / "c.txt").write_bytes(_text(2, 500))  # shorter than a window: not scored
    (folder / "ignored.bin").write_bytes(_text(3, 5000))
    return folder


def _save(module, path: Path, class_path: str | None) -> Path:
    """A checkpoint laid out as Lightning writes it (LightningCLI adds `_class_path`)."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    if class_path:
        checkpoint["hyper_parameters"]["_class_path"] = class_path
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def _evaluate(tmp_path, *args: str) -> dict:
    out = tmp_path / "out.json"
    main(["evaluate", *args, "--out", str(out), "--resamples", "200"])
    return json.loads(out.read_text())


def _soma(tmp_path) -> tuple[ZOModule, Path]:
    torch.manual_seed(0)
    module = ZOModule(num_experts=3, init="random", top_k=2, **TINY)
    with torch.no_grad():
        module.model.head.mul_(30)  # distinct experts, so that averaging and routing matter
    module.routing.router = Router(HashedNgramEncoder(dim=16), torch.randn(3, 16))
    return module, _save(module, tmp_path / "soma.ckpt", "soma_pl.lit.ZOModule")


def _windows(size: int) -> int:
    """Complete 1,025-byte windows advancing 768 bytes in a document of `size` bytes."""
    return 0 if size < WINDOW_BYTES else (size - WINDOW_BYTES) // 768 + 1


def test_windows_advance_768_bytes_so_every_byte_after_the_first_256_is_scored_once(corpus):
    """App. L.1: 1,025-byte windows at offsets 0, 768, 1536, ...; each scores its targets 257-1,024,
    so the scored bytes of consecutive windows follow one another; the incomplete last window and a
    document shorter than one window are dropped (the latter counted)."""
    data = read_windows(corpus)
    assert (data.files, data.documents, data.short_documents, len(data.windows)) == (3, 3, 1, 5)
    a = (corpus / "a.txt").read_bytes()
    assert _windows(len(a)) == 3 and _windows(2 * WINDOW_BYTES) == 2
    for i in range(3):
        assert data.windows[i].tobytes() == a[i * 768 : i * 768 + WINDOW_BYTES]
    scored = b"".join(data.windows[i, 257:].tobytes() for i in range(3))
    assert scored == a[257 : 3 * 768 + 257]
    assert list(data.doc_ids) == [str(corpus / "a.txt")] * 3 + [str(corpus / "sub" / "b.md")] * 2


def test_wikitext_articles_are_bootstrap_documents(tmp_path):
    body = _text(4, 2 * WINDOW_BYTES)
    text = b" = First = \n" + body + b"\n = = Section = = \n" + body + b"\n = Second = \n" + body
    (tmp_path / "wiki.test.tokens").write_bytes(text)
    data = read_windows(tmp_path / "wiki.test.tokens", DocumentSplit.wikitext)
    assert data.documents == 2  # the level-2 heading does not start an article
    first, second = text.index(b" = First"), text.index(b" = Second")
    assert len(data.windows) == _windows(second - first) + _windows(len(text) - second)
    assert len(set(data.doc_ids)) == 2


@pytest.mark.parametrize(("head", "skewed"), [(HeadMode.shared, False), (HeadMode.per_expert, True)])
def test_routed_top_k_equals_score_windows_for_every_k(head, skewed):
    """Skewed: every window ranks expert 3 first and expert 5 second, so those two run several slots
    of rows each while most experts run none."""
    torch.manual_seed(1)
    model = StackedExperts(16, 8, 8, 1, head, time_chunk=7)
    with torch.no_grad():
        model.head.mul_(30)
    windows = torch.randint(0, 256, (6, 41), dtype=torch.uint8)
    ranking = torch.stack([torch.randperm(16) for _ in range(6)])
    if skewed:
        rest = [e for e in range(16) if e not in (3, 5)]
        ranking = torch.stack([torch.tensor([3, 5, *torch.tensor(rest)[torch.randperm(14)].tolist()])
                               for _ in range(6)])
        assert slot_layout(ranking[:, :2], 16).expert.tolist() == [3] * 6 + [5] * 6  # rows = ceil(12 / 16)
    full = score_windows(model, ranking, windows, max_k=4, score_from=20)
    for k in (1, 2, 4):
        routed = score_top_k(model, ranking[:, :k], windows, score_from=20)
        torch.testing.assert_close(routed.loss, full.loss_by_k[:, k - 1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(routed.expert_losses, full.expert_losses.T.gather(1, ranking[:, :k]),
                                   rtol=1e-5, atol=1e-6)


def test_spsa_checkpoint_loss_equals_the_modules_own_window_losses(corpus, tmp_path):
    torch.manual_seed(2)
    module = ZOModule(**TINY)
    checkpoint = _save(module, tmp_path / "spsa.ckpt", "soma_pl.lit.ZOModule")
    report = _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus), "--batch_size", "2")
    windows = torch.from_numpy(read_windows(corpus).windows)
    expected = module.window_losses(windows)[0].double()  # an independent path: no routing code
    assert report["loss"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert (report["module"], report["k"], report["windows"], report["documents_scored"]) == ("ZOModule", 1, 5, 2)
    assert (report["scored_targets_per_window"], report["short_documents"]) == (WINDOW_BYTES - 1 - ROUTE_BYTES, 1)
    low, high = report["bootstrap_95"]
    assert low <= report["loss"] <= high and low < high


def test_progress_goes_to_stderr_and_json_to_stdout(corpus, tmp_path, capsys):
    _, checkpoint = _soma(tmp_path)
    report = _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus), "--batch_size", "2")
    printed = capsys.readouterr()
    assert json.loads(printed.out) == report
    assert "evaluate" in printed.err and "3/3" in printed.err  # 5 windows in batches of 2
    _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus), "--progress", "false")
    assert "3/3" not in capsys.readouterr().err


def test_soma_checkpoint_routes_with_its_own_router_and_averages_top_k(corpus, tmp_path):
    module, checkpoint = _soma(tmp_path)
    windows = torch.from_numpy(read_windows(corpus).windows)
    ranking = module.routing.router.ranking(windows)
    scores = score_windows(module.model, ranking, windows, max_k=3, score_from=ROUTE_BYTES)
    report = _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus))
    assert (report["module"], report["experts"], report["k"]) == ("ZOModule", 3, 2)
    assert report["loss"] == pytest.approx(float(scores.loss_by_k[:, 1].double().mean()), rel=1e-5)
    top1 = _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus), "--top_k", "1")
    assert top1["loss"] == pytest.approx(float(scores.loss_by_k[:, 0].double().mean()), rel=1e-5)
    assert top1["loss"] != pytest.approx(report["loss"], rel=1e-4)


def test_config_names_the_module_when_the_checkpoint_does_not(corpus, tmp_path, capsys):
    torch.manual_seed(3)
    module = ZOModule(**TINY)
    checkpoint = _save(module, tmp_path / "plain.ckpt", class_path=None)
    with pytest.raises(SystemExit) as exit_info:
        _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus))
    assert exit_info.value.code == 2 and "--config" in capsys.readouterr().err
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"model": {"class_path": "soma_pl.lit.ZOModule", "init_args": TINY}}))
    report = _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus), "--config", str(config))
    expected = module.window_losses(torch.from_numpy(read_windows(corpus).windows))[0].double().mean()
    assert report["loss"] == pytest.approx(float(expected), rel=1e-5)
    config.write_text(yaml.safe_dump({"model": {"class_path": "soma_pl.lit.ZOModule",
                                                "init_args": {"shape": {**TINY["shape"], "width": 12}}}}))
    with pytest.raises(SystemExit):
        _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(corpus), "--config", str(config))
    assert "shape" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing text", "empty file", "no text files", "too short", "missing checkpoint"])
def test_bad_input_ends_with_one_line(case, corpus, tmp_path, capsys):
    checkpoint = _save(ZOModule(**TINY), tmp_path / "spsa.ckpt", "soma_pl.lit.ZOModule")
    empty = tmp_path / "empty"
    empty.mkdir()
    text = {"missing text": tmp_path / "nope", "empty file": empty / "a.txt", "no text files": empty,
            "too short": corpus / "c.txt"}.get(case, corpus)
    if case == "empty file":
        text.write_bytes(b"")
    if case == "missing checkpoint":
        checkpoint = tmp_path / "nope.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        _evaluate(tmp_path, "--checkpoint", str(checkpoint), "--text", str(text))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("soma_pl: error:")
