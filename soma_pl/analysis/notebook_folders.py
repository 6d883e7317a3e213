"""Where the notebooks read results and save figures: `$SOMA_PL_RESULTS` and `$SOMA_PL_FIGURES`.

Jupyter, `jupyter-execute` and nbclient start a notebook's kernel in the notebook's own folder
(`notebooks/`), not where the user typed the command, so a relative folder would land inside
`notebooks/`. Relative values (and the defaults `results` and `figures`) are therefore taken
relative to the repository root: the nearest folder at or above the kernel's working directory
that holds both `pyproject.toml` and a `notebooks/` folder. Absolute values (and `~`) are used as
they are. Figures are never saved inside `notebooks/`, which holds the notebooks only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from soma_pl.errors import ConfigError

RESULTS_VARIABLE = "SOMA_PL_RESULTS"
"""Environment variable: the folder the notebooks read JSON and CSV results from."""
FIGURES_VARIABLE = "SOMA_PL_FIGURES"
"""Environment variable: the folder the notebooks save their PNG figures into."""
NOTEBOOKS = "notebooks"
"""The repository's notebook folder, beside `pyproject.toml`."""


@dataclass(frozen=True)
class NotebookFolders:
    """The two folders a notebook uses, absolute."""

    results: Path
    """Where the notebook reads results (`$SOMA_PL_RESULTS`, default `<repository>/results`)."""
    figures: Path
    """Where it saves its figures (`$SOMA_PL_FIGURES`, default `<repository>/figures`); created."""


def repository_root(start: Path) -> Path | None:
    """The nearest folder at or above `start` holding `pyproject.toml` and `notebooks/`; None if none."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() and (folder / NOTEBOOKS).is_dir():
            return folder
    return None


def _folder(variable: str, default: str, root: Path | None, start: Path) -> Path:
    value = os.environ.get(variable) or default
    path = Path(value).expanduser()
    if path.is_absolute():
        return path.resolve()
    if root is None:
        raise ConfigError(f"{variable}={value} is relative, and no repository root (a folder with pyproject.toml and "
                          f"{NOTEBOOKS}/) is at or above {start.resolve()}: give an absolute path")
    return (root / path).resolve()


def notebook_folders(start: Path | None = None) -> NotebookFolders:
    """The notebook's results and figures folders (see the module docstring); makes the figures folder.

    Args:
        start: the folder the repository root is looked for from; None: the working directory.

    Raises:
        ConfigError: a relative value with no repository root above `start`, or a figures folder
            inside the repository's `notebooks/`.
    """
    start = Path.cwd() if start is None else start
    root = repository_root(start)
    results = _folder(RESULTS_VARIABLE, "results", root, start)
    figures = _folder(FIGURES_VARIABLE, "figures", root, start)
    if root is not None and figures.is_relative_to(root / NOTEBOOKS):
        raise ConfigError(f"{FIGURES_VARIABLE}={os.environ.get(FIGURES_VARIABLE)} is inside {root / NOTEBOOKS}, which "
                          "holds the notebooks only: save figures elsewhere (a relative path starts at the "
                          "repository root)")
    figures.mkdir(parents=True, exist_ok=True)
    return NotebookFolders(results, figures)
