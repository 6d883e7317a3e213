"""Issue 30: weights are used only with the data they came from (one check on every path), a
non-finite result is an error, counts below one are refused, a pickle load is announced, and an
`--out` that cannot be written is refused before the work.

Every case runs the real CLI in-process: exit code 2 and one `soma_pl: error:` line, no traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from soma_pl.cli import main
from soma_pl.errors import DataError
from soma_pl.models.checkpoints import monolithic_state
from soma_pl.models.router import HashedNgramEncoder, Router
from tests.analysis.conftest import tiny_experts
from tests.data.corpora import write_jsonl_corpus
from tests.lit.conftest import fit_args
from tests.robustness.cli import cli as run
from tests.robustness.cli import one_error

SHARDING, OTHER = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A corpus, its prepared dataset `data` (tests/lit/tiny_spsa.yaml's settings), a 2-step run
    (`run/checkpoints/last.ckpt`), and `other`: the dataset with another fingerprint, as another
    preparation would have."""
    root = tmp_path_factory.mktemp("checks")
    write_jsonl_corpus(root / "corpus", {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    main(fit_args(root / "corpus", root / "data", root / "run", "--trainer.max_steps=2"))
    shutil.copytree(root / "data", root / "other")
    manifest = json.loads((root / "other" / "manifest.json").read_text())
    (root / "other" / "manifest.json").write_text(json.dumps({**manifest, "fingerprint": "f" * 64}))
    (root / "text.txt").write_text("river stone maple quartz lantern " * 300)
    return root


def fingerprint(folder: Path) -> str:
    return json.loads((folder / "manifest.json").read_text())["fingerprint"]


def last(root: Path) -> Path:
    return root / "run" / "checkpoints" / "last.ckpt"


def edited(source: Path, target: Path, edit) -> Path:
    checkpoint = torch.load(source, map_location="cpu", weights_only=False)
    edit(checkpoint)
    torch.save(checkpoint, target)
    return target


def experts_checkpoint(path: Path, dataset: str, scale: float = 1.0) -> Path:
    """Three stacked experts with the router of sharding SHARDING, trained (it records) on `dataset`."""
    model = tiny_experts(3)
    with torch.no_grad():
        for name in ("w_ih", "w_hh", "norm_gains"):
            getattr(model, name).mul_(scale)
    buffer = io.BytesIO()
    Router(HashedNgramEncoder(dim=32), torch.randn(3, 32), sharding=SHARDING).save_to(buffer)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "router": buffer.getvalue(),
                "ByteDataModule": {"fingerprints": {"dataset": dataset, "experts": SHARDING}}}, path)
    return path


# --- 5: weights only with the data they came from --------------------------------------------------------


def test_analyze_topk_refuses_a_router_of_another_sharding(root, tmp_path, capsys):
    checkpoint = experts_checkpoint(tmp_path / "soma.ckpt", fingerprint(root / "data"))
    base = ["analyze", "topk", f"--checkpoint={checkpoint}", f"--data={root / 'data'}", "--progress=false",
            f"--out={tmp_path / 'topk.json'}"]
    for sharding, expected in ((SHARDING, 0), (OTHER, 2)):
        Router(HashedNgramEncoder(dim=32), torch.randn(3, 32), sharding=sharding).save(tmp_path / "router.pt")
        code, errors = run(capsys, *base, f"--router={tmp_path / 'router.pt'}")
        assert code == expected, errors
    one_error((code, errors), f"router {tmp_path / 'router.pt'} comes from another sharding (fingerprint bbbbbbbbbbbb) "
                              f"than the one the experts of checkpoint {checkpoint} were trained on (fingerprint "
                              "aaaaaaaaaaaa)")


@pytest.mark.parametrize("command", ["topk", "error-correlation"])
def test_analyses_refuse_another_prepared_dataset(command, root, tmp_path, capsys):
    checkpoint = experts_checkpoint(tmp_path / "soma.ckpt", fingerprint(root / "data"))
    base = ["analyze", command, f"--checkpoint={checkpoint}", "--progress=false", f"--out={tmp_path / 'a.json'}"]
    assert run(capsys, *base, f"--data={root / 'data'}") == (0, [])
    one_error(run(capsys, *base, f"--data={root / 'other'}"),
              f"checkpoint {checkpoint} was trained on another prepared dataset (fingerprint "
              f"{fingerprint(root / 'data')[:12]}) than --data {root / 'other'} (fingerprint ffffffffffff)")


@pytest.mark.parametrize("setting", ["seed_checkpoint", "seed_checkpoint"])
def test_a_warm_start_from_another_prepared_dataset_is_refused(setting, root, tmp_path, capsys):
    """As `--ckpt_path` refuses it: the seed's training documents may be this dataset's held-out ones."""
    def elsewhere(checkpoint):
        checkpoint["ByteDataModule"]["fingerprints"]["dataset"] = "f" * 64

    seed = edited(last(root), tmp_path / "seed.ckpt", elsewhere)
    model = [f"--model.init_args.seed_checkpoint={seed}"] if setting == "seed_checkpoint" else [
        "--model=soma_pl.lit.ZOModule", "--model.init_args.num_experts=1", "--model.init_args.init=seed",
        f"--model.init_args.seed_checkpoint={seed}", "--model.init_args.shape.width=8",
        "--model.init_args.shape.num_layers=1", "--model.init_args.shape.embed_dim=8"]
    run_dir = tmp_path / "run"
    one_error(run(capsys, *fit_args(root / "corpus", root / "data", run_dir, "--trainer.max_steps=1", *model)),
              f"seed checkpoint {seed} was trained on another prepared dataset (fingerprint ffffffffffff) than "
              f"{root / 'data'} (fingerprint {fingerprint(root / 'data')[:12]})")
    assert not list(run_dir.rglob("*.ckpt"))
    # The same seed on the data it was trained on is accepted.
    state, _ = monolithic_state(last(root), {"dataset": (fingerprint(root / "data"), str(root / "data"))})
    assert "w_ih" in state
    with pytest.raises(DataError, match="was trained on another prepared dataset"):
        monolithic_state(seed, {"dataset": (fingerprint(root / "data"), str(root / "data"))})


# --- 6: a non-finite result is an error --------------------------------------------------------------------


@pytest.fixture(scope="module")
def diverged(root) -> Path:
    """The run's checkpoint with weights that are finite but overflow: every loss is NaN."""
    def overflow(checkpoint):
        for name in ("model.w_ih", "model.w_hh", "model.norm_gains"):
            checkpoint["state_dict"][name].fill_(3e38)

    return edited(last(root), root / "diverged.ckpt", overflow)


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_a_non_finite_loss_ends_validate_test_and_predict(command, root, diverged, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = fit_args(root / "corpus", root / "data", run_dir, f"--ckpt_path={diverged}")[1:]
    what = {"validate": "val/loss", "test": "test/loss", "predict": "the window losses"}[command]
    line = one_error(run(capsys, command, *args), f"{what} of checkpoint {diverged} ")
    assert ("is nan" if command != "predict" else "are not finite (4 of 4)") in line
    assert not list(run_dir.rglob("*.parquet")) and not list(run_dir.rglob("*_scores.json"))


def test_a_non_finite_loss_ends_evaluate_and_analyze_topk(root, diverged, tmp_path, capsys):
    out = tmp_path / "evaluate.json"
    one_error(run(capsys, "evaluate", f"--checkpoint={diverged}", f"--text={root / 'text.txt'}", "--resamples=10",
                  "--progress=false", f"--out={out}"),
              f"the window losses of checkpoint {diverged} are not finite")
    checkpoint = experts_checkpoint(tmp_path / "soma.ckpt", fingerprint(root / "data"), scale=3e38)
    one_error(run(capsys, "analyze", "topk", f"--checkpoint={checkpoint}", f"--data={root / 'data'}",
                  "--progress=false", f"--out={out}"),
              f"the top-k losses of checkpoint {checkpoint} are not finite")
    assert not out.exists()


# --- 7: counts below one -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "option", "value"), [
    ("evaluate", "max_windows", "-3"), ("evaluate", "max_windows", "0"), ("evaluate", "batch_size", "0"),
    ("analyze topk", "max_windows", "-60"), ("analyze topk", "max_windows", "0"), ("analyze topk", "batch_size", "0"),
    ("analyze error-correlation", "max_windows", "-1"),
])
def test_counts_below_one_are_refused(command, option, value, root, tmp_path, capsys):
    source = [f"--text={root / 'text.txt'}", "--resamples=10"] if command == "evaluate" else [f"--data={root / 'data'}"]
    checkpoint = last(root) if command == "evaluate" else experts_checkpoint(tmp_path / "e.ckpt", "")
    one_error(run(capsys, *command.split(), f"--checkpoint={checkpoint}", *source, f"--{option}={value}",
                  "--progress=false", f"--out={tmp_path / 'out.json'}"),
              f"{command}: --{option}={value} must be >= 1")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("options", [["--widths=[-8]"], ["--n_pert=0"], ["--widths=[8]", "--eggroll_widths=[0]"],
                                     ["--widths=[8]", "--soma_experts=-1"]])
def test_bench_zo_refuses_widths_and_counts_below_one(options, tmp_path, capsys):
    one_error(run(capsys, "bench", "zo", *options, f"--out={tmp_path / 'zo.json'}"), "bench zo: --")


# --- 13: a pickle load is announced ----------------------------------------------------------------------------


class Planted:
    """Unpickling this creates `marker`: what a crafted checkpoint's code would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_weights_only_false_still_loads_a_pickle_and_warns_naming_the_file(root, tmp_path, capsys):
    marker = tmp_path / "code_ran"
    planted = edited(last(root), tmp_path / "planted.ckpt", lambda c: c.update(planted=Planted(marker)))
    args = fit_args(root / "corpus", root / "data", tmp_path / "run", f"--ckpt_path={planted}")[1:]
    with pytest.warns(UserWarning, match=rf"--weights_only false: loading {planted} with pickle, which runs any "
                                         "code the file holds") as record:
        assert run(capsys, "validate", *args, "--weights_only=false") == (0, [])
    assert marker.exists(), "the explicit opt-in loads the pickle"
    [warning] = [w for w in record if "--weights_only false" in str(w.message)]
    # As the command prints it: through the formatter in effect (Lightning's wraps the CLI's).
    printed = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno)
    assert printed == f"warning: {warning.message}\n"


# --- one line for an --out that cannot be written, before the work -----------------------------------------------

WORK = {"evaluate": "soma_pl.evaluate_text.evaluate", "analyze topk": "soma_pl.analysis.topk.load_experts",
        "bench zo": "soma_pl.bench.zo.bench_zo", "bench inference": "soma_pl.bench.inference.bench_inference",
        "bench kernels": "soma_pl.bench.kernels.bench_kernels", "bench memory": "soma_pl.bench.memory.bench_memory"}
"""Each command's work: replaced by a failure, so a check made after it would show."""


def _never(*args, **kwargs):
    raise AssertionError("the work started before --out was checked")


def _command(name: str, root: Path) -> list[str]:
    inputs = {"evaluate": [f"--checkpoint={last(root)}", f"--text={root / 'text.txt'}"],
              "analyze topk": [f"--checkpoint={last(root)}", f"--data={root / 'data'}"]}
    return [*name.split(), *inputs.get(name, [])]


@pytest.mark.parametrize("name", list(WORK))
def test_an_out_under_a_regular_file_is_refused_before_the_work(name, root, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(WORK[name], _never)
    (tmp_path / "notes").write_text("mine")
    one_error(run(capsys, *_command(name, root), f"--out={tmp_path / 'notes' / 'x.json'}"),
              f"--out={tmp_path / 'notes' / 'x.json'}: {tmp_path / 'notes'} is a file, not a folder")
    assert (tmp_path / "notes").read_text() == "mine"


def test_an_out_that_is_a_folder_or_on_a_read_only_disk_is_refused_before_the_work(root, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setattr(WORK["evaluate"], _never)
    one_error(run(capsys, *_command("evaluate", root), f"--out={tmp_path}"), f"--out={tmp_path} is a folder")
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=statvfs(path).f_flag | os.ST_RDONLY))
    one_error(run(capsys, *_command("evaluate", root), f"--out={tmp_path / 'e.json'}"),
              f"--out={tmp_path / 'e.json'}: read-only file system (Errno 30): choose another --out on a writable disk")
