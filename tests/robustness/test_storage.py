"""A sweep storage Optuna cannot open ends `sweep` (and `sweep report`) with one line naming the
setting and the fix; `sweep report` creates no folder (a worker makes its storage file's folder:
tests/sweeps/test_exit_status.py)."""

from __future__ import annotations

import sys

import pytest

from soma_pl.cli import main
from soma_pl.sweeps.study import check_storage
from tests.sweeps.conftest import write_sweep


def _one_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("soma_pl: error:"), err
    return err[0]


@pytest.mark.parametrize("url", ["notaurl://", "://nothing", "sqlite+nodriver:///x.db"])
def test_an_unknown_url_scheme_names_the_setting_and_the_accepted_forms(url, tmp_path, capsys):
    line = _one_line(capsys, ["sweep", "--sweep", str(write_sweep(tmp_path)), "--storage", url])
    assert f"--storage {url}: not a database URL" in line and "sqlite:///PATH.db" in line
    assert not (tmp_path / "out").exists(), "nothing is written for a storage that cannot open"


def test_a_missing_database_driver_names_the_package_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    line = _one_line(capsys, ["sweep", "--sweep", str(write_sweep(tmp_path)),
                              "--storage", "postgresql://soma:secret@localhost/soma"])
    assert "--storage postgresql://soma:***@localhost/soma" in line and "secret" not in line
    assert "driver 'psycopg' is not installed: pip install 'psycopg[binary]'" in line


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_sweep_report_refuses_a_storage_file_in_a_missing_folder_and_creates_nothing(kind, tmp_path, capsys):
    missing = tmp_path / "nonexistent" / "dir"
    url = f"sqlite:///{missing / 'x.db'}" if kind == "sqlite" else str(missing / "journal.log")
    line = _one_line(capsys, ["sweep", "report", "--sweep", str(write_sweep(tmp_path)), "--storage", url,
                              "--out", str(tmp_path / "r.json")])
    assert f"storage {url}: folder {missing} of " in line
    assert not missing.parent.exists()


def test_a_storage_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    url = str(blocker / "journal.log")
    line = _one_line(capsys, ["sweep", "--sweep", str(write_sweep(tmp_path)), "--storage", url])
    assert f"--storage {url}: " in line and str(blocker) in line


def test_the_sweep_files_storage_is_named_by_its_file(tmp_path, capsys):
    sweep = write_sweep(tmp_path, storage="notaurl://")
    line = _one_line(capsys, ["sweep", "--sweep", str(sweep)])
    assert f"{sweep}: storage notaurl://: not a database URL" in line


def test_sweep_report_refuses_a_bad_storage_in_one_line(tmp_path, capsys):
    line = _one_line(capsys, ["sweep", "report", "--study", "unit", "--storage", "notaurl://",
                              "--out", str(tmp_path / "r.json")])
    assert "storage notaurl://: not a database URL" in line


def test_good_storages_pass_the_check(tmp_path):
    for url in (f"sqlite:///{tmp_path / 'x.db'}", str(tmp_path / "journal.log"), "sqlite://"):
        check_storage(url)
    assert list(tmp_path.iterdir()) == []  # checking creates nothing


def test_a_database_that_cannot_be_opened_is_one_line_after_the_retries(tmp_path, capsys):
    folder = tmp_path / "a_folder.db"  # SQLite cannot open a folder as its database
    folder.mkdir()
    line = _one_line(capsys, ["sweep", "--sweep", str(write_sweep(tmp_path)), "--storage", f"sqlite:///{folder}"])
    assert f"--storage sqlite:///{folder}: cannot open the database" in line and "unable to open" in line
