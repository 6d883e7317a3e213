"""`notebook_folders`: relative `$SOMA_PL_RESULTS` / `$SOMA_PL_FIGURES` start at the repository root
(found from the kernel's folder, `notebooks/` under Jupyter), absolute ones are kept, and figures
never go into `notebooks/`."""

from __future__ import annotations

from pathlib import Path

import pytest

from soma_pl.analysis.notebook_folders import NotebookFolders, notebook_folders, repository_root
from soma_pl.errors import ConfigError


@pytest.fixture()
def repository(tmp_path) -> Path:
    """A repository layout: pyproject.toml and notebooks/ (with a sub-folder) side by side."""
    root = tmp_path / "repository"
    (root / "notebooks" / "extra").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'soma_pl'\n")
    return root


@pytest.mark.parametrize("start", [".", "notebooks", "notebooks/extra"])
def test_relative_folders_start_at_the_repository_root(repository, start, monkeypatch):
    monkeypatch.setenv("SOMA_PL_RESULTS", "runs/../my results")
    monkeypatch.setenv("SOMA_PL_FIGURES", "out/figures")
    folders = notebook_folders(repository / start)
    assert folders == NotebookFolders(repository / "my results", repository / "out" / "figures")
    assert (repository / "out" / "figures").is_dir()  # made; the results folder is only read
    assert not (repository / "my results").exists()
    assert sorted(p.name for p in (repository / "notebooks").iterdir()) == ["extra"]


def test_the_kernels_working_directory_is_the_default_start(repository, monkeypatch):
    monkeypatch.chdir(repository / "notebooks")
    monkeypatch.delenv("SOMA_PL_RESULTS", raising=False)
    monkeypatch.setenv("SOMA_PL_FIGURES", "")  # empty: the default
    assert notebook_folders() == NotebookFolders(repository / "results", repository / "figures")


def test_absolute_and_home_folders_are_kept(repository, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SOMA_PL_RESULTS", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("SOMA_PL_FIGURES", "~/figures")
    assert notebook_folders(repository / "notebooks") == NotebookFolders(tmp_path / "elsewhere",
                                                                          tmp_path / "home" / "figures")


def test_a_folder_is_a_root_only_with_pyproject_and_notebooks(tmp_path):
    (tmp_path / "only_pyproject").mkdir()
    (tmp_path / "only_pyproject" / "pyproject.toml").write_text("")
    (tmp_path / "only_notebooks" / "notebooks").mkdir(parents=True)
    assert repository_root(tmp_path / "only_pyproject") is None
    assert repository_root(tmp_path / "only_notebooks" / "notebooks") is None


def test_relative_folders_without_a_repository_are_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SOMA_PL_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("SOMA_PL_FIGURES", "figures")
    with pytest.raises(ConfigError) as error:
        notebook_folders(tmp_path)
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("SOMA_PL_FIGURES=figures is relative") and "absolute path" in message
    assert not (tmp_path / "figures").exists()
    monkeypatch.setenv("SOMA_PL_FIGURES", str(tmp_path / "figures"))  # absolute: no root needed
    assert notebook_folders(tmp_path).figures == tmp_path / "figures"


@pytest.mark.parametrize("figures", ["notebooks/figures", "ABSOLUTE"])
def test_figures_inside_notebooks_are_refused(repository, figures, monkeypatch):
    value = str(repository / "notebooks" / "figures") if figures == "ABSOLUTE" else figures
    monkeypatch.setenv("SOMA_PL_FIGURES", value)
    with pytest.raises(ConfigError, match=r"^SOMA_PL_FIGURES=.* is inside .*notebooks, which holds the notebooks only"):
        notebook_folders(repository / "notebooks")
    assert sorted(p.name for p in (repository / "notebooks").iterdir()) == ["extra"]
