"""Issue 30: prepare and shard replace only what they wrote, resume to the data of a clean build,
and meet bad input with one line.

Every CLI case runs in-process and expects exit code 2 with one `soma_pl: error:` line.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import yaml

from soma_pl.cli import main
from soma_pl.errors import DataError
from soma_pl.io import OUTPUT_MARKER
from tests.data.corpora import write_jsonl_corpus
from tests.robustness.cli import cli, one_error
from tests.robustness.test_data_safety import SMALL, TINY_SOMA, listing, prepare_args, shard_args

IN_PROCESS = "--dataset.executor.workers=1"
"""One worker runs the tasks one after another in this process, so they see its patches. (Forked
workers would too, but a fork of this process, which holds torch's thread pools, can hang on a lock
one of those threads held: `default_start_method`.)"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A corpus, its prepared dataset and a sharding of it; tests copy the folders they change."""
    root = tmp_path_factory.mktemp("built")
    write_jsonl_corpus(root / "corpus", {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    main(prepare_args(root / "corpus", root / "data"))
    main(shard_args(root / "data", root / "experts"))
    return root / "corpus", root / "data", root / "experts"


def copied(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


# --- data loss -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, planted", [("prepare", "train/notes.txt"), ("prepare", "expert_val/sub/keep.txt"),
                                              ("shard", "expert-000/notes.txt")])
def test_a_foreign_file_in_a_sub_folder_stops_a_rebuild(capsys, built, tmp_path, command, planted):
    corpus, data, experts = built
    output = copied(data if command == "prepare" else experts, tmp_path / "out")
    (output / planted).parent.mkdir(parents=True, exist_ok=True)
    (output / planted).write_text("mine")
    before = listing(output)
    args = (prepare_args(corpus, output, "--dataset.seed=1") if command == "prepare"
            else shard_args(data, output, "--shard.seed=1"))
    one_error(cli(capsys, *args), f"{output} holds files soma_pl did not write ({planted})")
    assert listing(output) == before


def test_a_marker_that_lists_only_top_level_entries_stops_a_rebuild(capsys, built, tmp_path):
    """An older soma_pl's marker names the top-level entries only: what its sub-folders hold is unknown."""
    corpus, data, _ = built
    output = copied(data, tmp_path / "out")
    marker = json.loads((output / OUTPUT_MARKER).read_text())
    marker.pop("files", None)
    marker["entries"] = sorted(p.name for p in output.iterdir() if p.name != OUTPUT_MARKER)
    (output / OUTPUT_MARKER).write_text(json.dumps(marker))
    before = listing(output)
    one_error(cli(capsys, *prepare_args(corpus, output, "--dataset.seed=1")),
              f"dataset.output_dir={output}: its {OUTPUT_MARKER} does not list the files soma_pl wrote there")
    assert listing(output) == before


@pytest.mark.parametrize("command", ["prepare", "shard"])
def test_a_folder_without_the_marker_is_not_replaced_whatever_its_manifest(capsys, built, tmp_path, command):
    corpus, data, _ = built
    output = tmp_path / "mine"
    output.mkdir()
    name = "manifest.json" if command == "prepare" else "experts.json"
    (output / name).write_text(json.dumps({"fingerprint": "0" * 64, "format": 4}))
    (output / "notes.txt").write_text("mine")
    before = listing(output)
    args = prepare_args(corpus, output) if command == "prepare" else shard_args(data, output)
    one_error(cli(capsys, *args), f"{output} exists and soma_pl did not write it")
    assert listing(output) == before


def test_bench_data_reads_an_existing_dataset_as_it_is(capsys, built, tmp_path):
    corpus, data, _ = built
    output = copied(data, tmp_path / "data")
    before = listing(output)
    code, errors = cli(capsys, "bench", "data", "--dataset.corpus.kind=jsonl", f"--dataset.corpus.paths=[{corpus}]",
                       f"--dataset.output_dir={output}", *(f"--dataset.{k}={v}" for k, v in SMALL.items()),
                       "--dataset.seed=5", "--batch_size=2", "--batches=2",
                       "--workers=[0]", f"--out={tmp_path / 'bench.json'}")
    assert (code, errors) == (0, [])
    assert listing(output) == before
    assert json.loads((tmp_path / "bench.json").read_text())["results"][0]["batches"] == 2


# --- resume ---------------------------------------------------------------------------------------------


def test_a_resume_at_another_task_count_gives_the_data_of_a_clean_build(capsys, built, tmp_path, monkeypatch):
    from soma_pl.data.preparation.steps import PlanHeldOut

    corpus, _, _ = built
    output, clean = tmp_path / "resumed", tmp_path / "clean"

    def killed(self, *args, **kwargs):
        raise DataError("killed after the select stage")
        yield

    with monkeypatch.context() as patch:
        patch.setattr(PlanHeldOut, "run", killed)
        one_error(cli(capsys, *prepare_args(corpus, output, "--dataset.executor.tasks=2", IN_PROCESS)), "killed after")
    assert cli(capsys, *prepare_args(corpus, output, "--dataset.executor.tasks=1", IN_PROCESS)) == (0, [])
    assert cli(capsys, *prepare_args(corpus, clean, "--dataset.executor.tasks=1", IN_PROCESS)) == (0, [])
    resumed_files, clean_files = listing(output), listing(clean)
    for name in ("ensemble_val.npz", "test.npz"):
        assert resumed_files[name] == clean_files[name]
    resumed, expected = (json.loads((folder / "manifest.json").read_text()) for folder in (output, clean))
    assert resumed["train"] == expected["train"] and resumed["expert_val"] == expected["expert_val"]


@pytest.mark.parametrize("command", ["prepare", "shard"])
def test_a_finished_build_whose_output_was_removed_is_rebuilt(capsys, built, tmp_path, monkeypatch, command):
    corpus, data, _ = built
    output = tmp_path / "out"
    args = prepare_args(corpus, output) if command == "prepare" else shard_args(data, output)
    module = "soma_pl.data.preparation.prepare" if command == "prepare" else "soma_pl.data.sharding.shard"
    with monkeypatch.context() as patch:  # killed after the finish stage's marker, before the cleanup
        patch.setattr(f"{module}.remove_staging", lambda *args: None)
        assert cli(capsys, *args) == (0, [])
    shutil.rmtree(output)
    assert cli(capsys, *args) == (0, [])
    assert (output / ("manifest.json" if command == "prepare" else "experts.json")).is_file()


# --- one line for bad input ----------------------------------------------------------------------------


MALFORMED = {"no train": lambda manifest: {k: v for k, v in manifest.items() if k != "train"},
             "a list": lambda manifest: []}


@pytest.mark.parametrize("how", MALFORMED)
def test_a_malformed_manifest_is_one_line_for_shard_and_fit(capsys, built, tmp_path, how):
    corpus, data, _ = built
    broken = copied(data, tmp_path / "data")
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps(MALFORMED[how](manifest)))
    expected = f"{broken / 'manifest.json'}"
    one_error(cli(capsys, *shard_args(broken, tmp_path / "experts")), expected)
    config = yaml.safe_load(TINY_SOMA.read_text())
    config["data"]["init_args"] = {"prepared": str(broken), "batch_size": 2, "eval_batch_size": 8}
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    one_error(cli(capsys, "fit", "--config", str(tmp_path / "fit.yaml"), f"--trainer.default_root_dir={tmp_path}",
                  "--trainer.logger=false"), expected)


@pytest.mark.parametrize("command", ["prepare", "shard"])
def test_a_read_only_disk_is_one_line(capsys, built, tmp_path, monkeypatch, command):
    """Nothing can be made under `out` (running as root, a chmod would not stop the writes)."""
    corpus, data, _ = built
    disk = tmp_path / "out"
    disk.mkdir()
    original = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if Path(self).absolute().is_relative_to(disk):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    output = disk / "built"
    args = prepare_args(corpus, output) if command == "prepare" else shard_args(data, output)
    setting = "dataset" if command == "prepare" else "shard"
    one_error(cli(capsys, *args), f"{setting}.output_dir={output}: read-only file system (Errno 30)")
    assert list(disk.iterdir()) == []


@pytest.mark.parametrize("command", ["prepare", "shard"])
def test_an_output_under_a_regular_file_is_one_line(capsys, built, tmp_path, command):
    corpus, data, _ = built
    (tmp_path / "somefile").write_text("x")
    output = tmp_path / "somefile" / "sub"
    args = prepare_args(corpus, output) if command == "prepare" else shard_args(data, output)
    setting = "dataset" if command == "prepare" else "shard"
    one_error(cli(capsys, *args), f"{setting}.output_dir={output}", f"{tmp_path / 'somefile'} is a file")
    assert (tmp_path / "somefile").read_text() == "x"


@pytest.mark.parametrize("setting, value, expected", [
    ("dataset.executor.options", "{start_method: bogus}", "dataset.executor.options.start_method=bogus"),
    ("shard.executor.options", "{start_method: bogus}", "shard.executor.options.start_method=bogus"),
    ("dataset.shard_max_bytes", "-1", "dataset.shard_max_bytes=-1 must be >= 1"),
    ("shard.shard_max_bytes", "-1", "shard.shard_max_bytes=-1 must be >= 1"),
])
def test_bad_executor_options_and_shard_sizes_are_one_line(capsys, built, tmp_path, setting, value, expected):
    corpus, data, _ = built
    output = tmp_path / "out"
    args = (prepare_args(corpus, output) if setting.startswith("dataset") else shard_args(data, output))
    one_error(cli(capsys, *args, f"--{setting}={value}"), expected)
    assert not output.exists()
