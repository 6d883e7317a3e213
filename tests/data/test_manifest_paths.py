"""What a manifest names stays inside its dataset folder, and evaluation sets are the files prepare
wrote: a path out of the folder (even with matching size and sha256) and an altered `.npz` are
refused with one `DataError` naming the file."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.expert_sets import ExpertShardWriter, read_expert_shards, write_experts_manifest
from soma_pl.data.formats.manifest import MANIFEST, read_manifest
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import DataError

from .corpora import write_jsonl_corpus


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One small prepared dataset; each test alters a copy of it."""
    folder = tmp_path_factory.mktemp("built")
    write_jsonl_corpus(folder / "corpus", {"alpha": 60, "beta": 60})
    config = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder / "corpus")]),
                           output_dir=str(folder / "prepared"), val_documents=4, val_windows=8, test_windows=6)
    return prepare(config, progress=False)


@pytest.fixture
def prepared(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "prepared"))


def _module(folder: Path) -> ByteDataModule:
    return ByteDataModule(prepared=str(folder), batch_size=4, auto_prepare=False)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rewrite(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("key", ["train", "expert_val", "ensemble_val", "test"])
def test_a_manifest_path_outside_the_dataset_folder_is_refused(key, prepared):
    escape = "../" * (len(prepared.parts) - 1) + "etc/passwd"  # the issue's ../../../../etc/passwd, at this depth
    target = prepared / escape
    assert target.resolve() == Path("/etc/passwd") and target.is_file()

    def point_outside(manifest: dict) -> None:
        if key in ("train", "expert_val"):  # the record matches the file it names, as an attacker would make it
            manifest[key]["shards"][0].update(path=escape, bytes=target.stat().st_size, sha256=_sha256(target))
        else:
            manifest[key].update(file=escape, sha256=_sha256(target))

    _rewrite(prepared, point_outside)
    with pytest.raises(DataError) as refused:
        read_manifest(prepared)
    assert str(prepared / MANIFEST) in str(refused.value) and escape in str(refused.value)
    with pytest.raises(DataError) as refused:
        _module(prepared).setup("fit")
    assert str(prepared / MANIFEST) in str(refused.value)


@pytest.mark.parametrize("escape", ["../../../../etc/passwd", "/etc/passwd"])
def test_an_experts_manifest_path_outside_its_folder_is_refused(escape, tmp_path):
    folder = tmp_path / "experts"
    write_experts_manifest(folder, ExpertShardWriter(folder, 1, 10_000).close())
    payload = json.loads((folder / "experts.json").read_text())
    payload["experts"][0]["train"] = [{"path": escape, "sha256": "0" * 64, "bytes": 1, "documents": 1}]
    (folder / "experts.json").write_text(json.dumps(payload))
    with pytest.raises(DataError) as refused:
        read_expert_shards(folder)
    assert str(folder / "experts.json") in str(refused.value)


def test_prepare_records_each_evaluation_sets_sha256(prepared):
    manifest = read_manifest(prepared)
    for key in ("ensemble_val", "test"):
        assert manifest[key]["sha256"] == _sha256(prepared / manifest[key]["file"])


@pytest.mark.parametrize("key", ["ensemble_val", "test"])
def test_an_altered_evaluation_set_is_one_line_naming_it(key, prepared):
    # Another valid set of windows in its place: it loads, and would be scored (or index past its end).
    other = "test.npz" if key == "ensemble_val" else "ensemble_val.npz"
    altered = prepared / f"{key}.npz"
    shutil.copyfile(prepared / other, altered)
    with pytest.raises(DataError) as refused:
        _module(prepared).setup("fit")
    assert str(altered) in str(refused.value)
