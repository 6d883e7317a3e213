"""A recipe (`data.init_args.recipe`, `shard.recipe`) builds its folder on first use and rebuilds
what it built, but never replaces a prepared dataset that it did not build (issue 32, item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from soma_pl.data.formats.manifest import existing_fingerprint
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import ConfigError
from soma_pl.io import read_marker
from tests.data.corpora import write_jsonl_corpus
from tests.robustness.cli import cli, one_error
from tests.robustness.test_data_safety import SMALL, listing, prepare_args, shard_args


def write_recipe(path: Path, corpus: Path, seed: int = 0) -> Path:
    """A data config whose `dataset:` section prepares `corpus` as the robustness tests do."""
    dataset = {"corpus": {"kind": "jsonl", "paths": [str(corpus)]}, "output_dir": "unused", "seed": seed, **SMALL}
    path.write_text(yaml.safe_dump({"dataset": dataset}))
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("recipes")
    write_jsonl_corpus(root / "mine", {"alpha": 30, "beta": 30}, min_words=150, max_words=600)
    write_jsonl_corpus(root / "recipe", {"gamma": 30, "delta": 30}, min_words=150, max_words=600, seed=1)
    return root / "mine", root / "recipe"


def test_a_recipe_never_rebuilds_a_dataset_that_prepare_built(corpora, tmp_path, capsys):
    mine, theirs = corpora
    users = tmp_path / "users-data"
    assert cli(capsys, *prepare_args(mine, users)) == (0, [])
    before = listing(users)
    recipe = write_recipe(tmp_path / "recipe.yaml", theirs)
    with pytest.raises(ConfigError, match=f"data.init_args.prepared={users} holds a prepared dataset .* that the "
                                          f"recipe {recipe} did not build"):
        ByteDataModule(prepared=str(users), recipe=str(recipe)).prepare_data()
    one_error(cli(capsys, *shard_args(users, tmp_path / "experts", f"--shard.recipe={recipe}")),
              f"shard.prepared={users} holds a prepared dataset", "set the recipe to null")
    assert listing(users) == before
    assert not (tmp_path / "experts").exists()


def test_a_recipe_rebuilds_what_it_built_when_it_changes(corpora, tmp_path):
    _, theirs = corpora
    folder, recipe = tmp_path / "recipe-data", tmp_path / "recipe.yaml"
    ByteDataModule(prepared=str(folder), recipe=str(write_recipe(recipe, theirs))).prepare_data()
    first = existing_fingerprint(folder)
    assert read_marker(folder)["recipe"] == str(recipe.resolve())
    ByteDataModule(prepared=str(folder), recipe=str(write_recipe(recipe, theirs, seed=1))).prepare_data()
    assert first is not None and existing_fingerprint(folder) not in (None, first)
