"""Issue 12: prepare and shard lose nothing, and nothing reads silently wrong data.

Every case runs the real CLI in-process and expects exit code 2 with one `soma_pl: error:` line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from soma_pl.cli import main
from soma_pl.data.formats.tar_shards import ShardWriter
from soma_pl.errors import ConfigError
from soma_pl.lit import ZOModule
from soma_pl.lit.args import ModelShape
from soma_pl.models.router import HashedNgramEncoder, Router
from tests.data.corpora import write_jsonl_corpus
from tests.robustness.cli import cli, one_error

TINY_SOMA = Path(__file__).parents[1] / "lit" / "tiny_soma.yaml"
SMALL = {"val_documents": 2, "val_windows": 4, "test_windows": 4, "shard_max_bytes": 40000, "expert_val_fraction": 0.05}
"""The prepare settings of tests/lit/tiny_soma.yaml, so its runs reuse the datasets made here."""


def prepare_args(corpus: Path, output: Path, *extra: str) -> list[str]:
    return ["prepare", "--dataset.corpus.kind=jsonl", f"--dataset.corpus.paths=[{corpus}]",
            f"--dataset.output_dir={output}", *(f"--dataset.{k}={v}" for k, v in SMALL.items()),
            "--progress=false", *extra]


def shard_args(dataset: Path, output: Path, *extra: str) -> list[str]:
    return ["shard", f"--shard.prepared={dataset}", "--shard.num_experts=2",
            "--shard.shard_max_bytes=40000", f"--shard.output_dir={output}", "--progress=false", *extra]


def soma_args(corpus: Path, dataset: Path, experts: Path, run: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY_SOMA), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
            f"--data.init_args.dataset.output_dir={dataset}", f"--data.init_args.experts_dir={experts}",
            f"--trainer.default_root_dir={run}", "--trainer.logger=false", *extra]


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    write_jsonl_corpus(folder, {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    return folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """A corpus, its prepared dataset, and two shardings of it (seeds 0 and 7)."""
    root = tmp_path_factory.mktemp("sharded")
    write_jsonl_corpus(root / "corpus", {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    main(prepare_args(root / "corpus", root / "data"))
    for name, seed in (("experts", 0), ("experts7", 7)):
        main(shard_args(root / "data", root / name, f"--shard.seed={seed}"))
    return root / "corpus", root / "data", root / "experts", root / "experts7"


# --- data loss -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["is", "holds", "lies inside"])
def test_prepare_refuses_an_output_that_is_holds_or_lies_inside_the_corpus(capsys, corpus, where):
    before = listing(corpus)
    paths, output = {"is": (corpus, corpus), "holds": (corpus / "alpha.jsonl", corpus),
                     "lies inside": (corpus, corpus / "prepared")}[where]
    one_error(cli(capsys, *prepare_args(paths, output)), f"dataset.output_dir={output} {where} the input")
    assert listing(corpus) == before


def test_shard_refuses_a_folder_it_did_not_write_and_the_prepared_datasets_parent(capsys, corpus, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert cli(capsys, *prepare_args(corpus, tmp_path / "work" / "data")) == (0, [])
    data = listing(tmp_path / "work" / "data")
    one_error(cli(capsys, *shard_args(tmp_path / "work" / "data", mine)),
              f"shard.output_dir={mine} exists and soma_pl did not write it")
    assert listing(mine) == {"notes.txt": b"mine"}
    one_error(cli(capsys, *shard_args(tmp_path / "work" / "data", tmp_path / "work")),
              f"shard.output_dir={tmp_path / 'work'} holds the input")
    assert listing(tmp_path / "work" / "data") == data


def test_a_folder_soma_pl_wrote_is_replaced_unless_it_holds_foreign_files(capsys, corpus, tmp_path):
    output = tmp_path / "prepared"
    assert cli(capsys, *prepare_args(corpus, output)) == (0, [])
    assert cli(capsys, *prepare_args(corpus, output, "--dataset.seed=1")) == (0, [])  # its own: rebuilt
    (output / "notes.txt").write_text("mine")
    one_error(cli(capsys, *prepare_args(corpus, output, "--dataset.seed=2")), "files soma_pl did not write (notes.txt)")
    assert (output / "notes.txt").read_text() == "mine"
    assert json.loads((output / "manifest.json").read_text())["seed"] == 1
    assert json.loads((output / ".soma_pl-output.json").read_text())["kind"] == "prepared dataset"


def test_check_output_accepts_empty_folders_only_without_the_marker(tmp_path):
    """Only the marker proves ownership: a manifest, even one with a fingerprint, does not."""
    from soma_pl.io import check_output

    empty, legacy, other = tmp_path / "empty", tmp_path / "legacy", tmp_path / "other"
    for folder in (empty, legacy, other):
        folder.mkdir()
    (legacy / "manifest.json").write_text(json.dumps({"fingerprint": "abc", "format": 3}))
    (other / "manifest.json").write_text(json.dumps({"name": "a web app"}))
    check_output(empty, "prepared dataset", "dataset.output_dir")
    for folder in (legacy, other):
        with pytest.raises(ConfigError, match="soma_pl did not write it"):
            check_output(folder, "prepared dataset", "dataset.output_dir")


def test_leftovers_of_dead_processes_are_removed_and_live_ones_kept(capsys, corpus, tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True)
    dead, alive = int(finished.stdout), os.getppid()
    for pid in (dead, alive):
        (tmp_path / f".prepared.tmp-{pid}" / "train").mkdir(parents=True)
        (tmp_path / f".prepared.tmp-{pid}" / "train" / "train-000000.tar").write_bytes(b"x" * 1000)
    (tmp_path / f".prepared.old-{dead}").mkdir()
    assert cli(capsys, *prepare_args(corpus, tmp_path / "prepared")) == (0, [])
    assert not (tmp_path / f".prepared.tmp-{dead}").exists() and not (tmp_path / f".prepared.old-{dead}").exists()
    assert (tmp_path / f".prepared.tmp-{alive}").is_dir()


def test_a_corpus_file_vanishing_between_the_passes_stops_prepare(capsys, corpus, tmp_path, monkeypatch):
    from soma_pl.data.preparation.steps import PlanHeldOut

    original = PlanHeldOut.run

    def plan_then_delete(self, *args, **kwargs):
        yield from original(self, *args, **kwargs)
        (corpus / "beta.jsonl").unlink()  # between the pass that selects held-out documents and the one that writes

    monkeypatch.setattr(PlanHeldOut, "run", plan_then_delete)
    one_error(cli(capsys, *prepare_args(corpus, tmp_path / "prepared")),
              "the corpus changed while prepare read it", f"{(corpus / 'beta.jsonl').resolve()} disappeared")
    # Nothing reads as prepared; only the staging folder of the finished tasks remains, for a rerun.
    assert [name for name in sorted(os.listdir(tmp_path)) if not name.startswith(".prepared.prepare-")] == ["corpus"]


# --- silent wrong results ------------------------------------------------------------------------------


def test_experts_of_another_preparation_are_refused(capsys, sharded, tmp_path):
    corpus, data, experts, _ = sharded
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    assert cli(capsys, "validate", *soma_args(corpus, copy, experts, tmp_path / "run")) == (0, [])
    # Re-prepared at another seed (auto_prepare rebuilds it): other documents are held out now.
    for command in ("validate", "test"):
        one_error(cli(capsys, command, *soma_args(corpus, copy, experts, tmp_path / "run",
                                                  "--data.init_args.dataset.seed=1")),
                  f"experts_dir={experts} was sharded from another prepared dataset than {copy}")


def test_a_checkpoint_is_refused_on_another_prepared_dataset(capsys, tmp_path):
    """The datamodule records the prepared dataset's fingerprint in each checkpoint; validate, test
    and a resumed fit on a dataset prepared otherwise (another seed: other held-out documents) stop."""
    from tests.lit.conftest import fit_args

    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus, {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    run, data = tmp_path / "run", tmp_path / "data"
    assert cli(capsys, *fit_args(corpus, data, run, "--trainer.max_steps=2"))[0] == 0
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    recorded = checkpoint["ByteDataModule"]["fingerprints"]["dataset"]
    assert recorded == json.loads((data / "manifest.json").read_text())["fingerprint"]
    same = fit_args(corpus, data, run)[1:]  # the same data: accepted
    assert cli(capsys, "validate", *same, f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}")[0] == 0
    other = fit_args(corpus, tmp_path / "other", run, "--data.init_args.dataset.seed=1")[1:]
    for command in ("validate", "test", "fit"):
        one_error(cli(capsys, command, *other, f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}"),
                  f"the checkpoint was trained on another prepared dataset (fingerprint {recorded[:12]})",
                  f"than {tmp_path / 'other'} (fingerprint")


def test_a_router_of_another_sharding_is_refused(capsys, sharded, tmp_path):
    corpus, data, experts, experts7 = sharded
    one_error(cli(capsys, "fit", *soma_args(corpus, data, experts, tmp_path / "run",
                                            f"--model.init_args.router_path={experts7 / 'router.pt'}")),
              f"router {experts7 / 'router.pt'} comes from another sharding",
              f"than data.init_args.experts_dir={experts}")


def test_evaluate_refuses_a_router_of_another_sharding_than_the_checkpoints(capsys, tmp_path):
    torch.manual_seed(0)
    module = ZOModule(num_experts=2, init="random", shape=ModelShape(width=8, num_layers=1, embed_dim=8))
    encoder, centroids = HashedNgramEncoder(dim=16), torch.randn(2, 16)
    module.routing.router = Router(encoder, centroids, sharding="a" * 64)
    checkpoint = {"state_dict": module.state_dict(),
                  "hyper_parameters": {**module.hparams, "_class_path": "soma_pl.lit.ZOModule"}}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "soma.ckpt")
    (tmp_path / "text.txt").write_text("river stone maple " * 200)
    base = ["evaluate", f"--checkpoint={tmp_path / 'soma.ckpt'}", f"--text={tmp_path / 'text.txt'}",
            "--resamples=10", f"--out={tmp_path / 'out.json'}"]
    for sharding, expected in (("a" * 64, 0), ("b" * 64, 2)):
        Router(encoder, centroids, sharding=sharding).save(tmp_path / "router.pt")
        code, errors = cli(capsys, *base, f"--router={tmp_path / 'router.pt'}")
        assert code == expected
    one_error((code, errors), f"--router {tmp_path / 'router.pt'} comes from another sharding",
              "(fingerprint bbbbbbbbbbbb) than the one this checkpoint's experts were trained on",
              "(fingerprint aaaaaaaaaaaa)")


# --- one clear line for every bad input ----------------------------------------------------------------


def test_a_lone_surrogate_in_jsonl_is_one_line(capsys, corpus, tmp_path):
    with open(corpus / "beta.jsonl", "a") as handle:
        handle.write('{"text": "abc \\ud800 def"}\n')
    one_error(cli(capsys, *prepare_args(corpus, tmp_path / "prepared")),
              f"{corpus / 'beta.jsonl'}:31: invalid Unicode in the text (a lone surrogate")
    assert not (tmp_path / "prepared").exists()


def test_an_unknown_demo_source_is_one_line(capsys, tmp_path):
    one_error(cli(capsys, "prepare", "--dataset.corpus.demo_sources=[wikipedia,gutenberg]",
                  f"--dataset.output_dir={tmp_path / 'demo'}", "--progress=false"),
              "corpus.demo_sources: unknown demo source 'gutenberg'; valid: wikipedia, sotu, python_docs")


def _read_only(monkeypatch) -> None:
    """Every temporary output folder lands on a read-only file system."""
    original = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if ".tmp-" in self.name:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)


def _full_disk(monkeypatch, cls, after: int) -> None:
    """`cls.write` fills the disk after `after` documents."""
    original, written = cls.write, []

    def write(self, *args, **kwargs):
        written.append(1)
        if len(written) > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "write", write)


@pytest.mark.parametrize("failure", ["read-only", "full"])
@pytest.mark.parametrize("command", ["prepare", "shard"])
def test_a_read_only_or_full_disk_is_one_line_and_leaves_nothing(capsys, request, tmp_path, monkeypatch, command,
                                                                failure):
    output = tmp_path / "out" / command
    # The patched writer below must be the one the tasks use: one worker runs prepare's tasks in this
    # process, one after another, and shard's one task runs here too. (A fork of this process, which
    # holds torch's thread pools, can hang on a lock: `default_start_method`.)
    if command == "prepare":
        corpus = request.getfixturevalue("corpus")
        args = prepare_args(corpus, output, "--dataset.executor.workers=1")
        writer, setting = ShardWriter, "dataset"
    else:
        corpus, data, _, _ = request.getfixturevalue("sharded")
        args, writer, setting = shard_args(data, output, "--shard.executor.tasks=1"), ShardWriter, "shard"
    if failure == "read-only":
        _read_only(monkeypatch)
        message = f"read-only file system (Errno 30): choose another {setting}.output_dir on a writable disk"
    else:
        _full_disk(monkeypatch, writer, after=5)
        message = f"no space left on device (Errno 28): free space there or choose another {setting}.output_dir"
    one_error(cli(capsys, *args), f"{setting}.output_dir={output}: {message}")
    assert os.listdir(tmp_path / "out") == []


def test_a_permission_error_on_an_input_is_not_reported_as_a_write_error(tmp_path):
    from soma_pl.io import write_error

    output = tmp_path / "out" / "prepared"
    work = tmp_path / "out" / ".prepared.tmp-1"
    denied = OSError(errno.EACCES, "Permission denied", str(tmp_path / "corpus" / "a.jsonl"))
    assert write_error(denied, [work, output], "dataset.output_dir=x", "choose another") is None
    denied.filename = str(work / "train" / "train-000000.tar")
    assert "permission denied" in str(write_error(denied, [work, output], "dataset.output_dir=x", "choose another"))
