"""`prepare`: turn a corpus into a prepared dataset folder, as a datatrove pipeline.

```
<output_dir>/
  train/train-<task>-NNNNNN.tar  training documents, WebDataset shards cut by size, per task
  expert_val/val-<task>-NNNNNN.tar the held-out 1% of the training documents: a monolithic model's
                               learning-rate decay signal (N = 1 is one expert, Table 1)
  ensemble_val.npz             fixed 1,025-byte windows from held-out documents
  test.npz                     one window per held-out, overlap-screened test document
  test_final.npz               the final test split (with `final_test_windows`): more screened test
                               documents, reported only by a reproduction's final runs
  manifest.json                counts, bytes, sources, seed, screening, sha256 of every shard
```

The stages (`soma_pl.data.preparation.steps`) run on the executor of `dataset.executor` (local by
default, all cores; Slurm or Ray for clusters). Held-out documents are those of smallest seeded
hash of the id; a seeded hash of the id also sends `expert_val_fraction` of the training documents
(at least one) to the expert-validation split. Both choices are the same for any task count and
any order or partition of the corpus; only the grouping of documents into shard files depends on
the task count. The overlap screen is exact (any shared 50-byte substring excludes a test
candidate) and runs in every task over that task's documents.

Everything is built in a staging folder beside the output, named after the build's fingerprint and
task count; datatrove's completion markers there let a killed run resume where it stopped (at
another task count a run starts afresh: each task's share of the corpus differs). The finished
folder is renamed into place with its manifest, so nothing half-written ever reads as a prepared
dataset.
The manifest records a hash of the config and of the corpus's identity: an identical re-run is a
no-op, a changed one rebuilds. The last stage checks that the corpus files are still those (paths,
sizes, mtimes) seen at the start. Only a folder soma_pl wrote as a prepared dataset is replaced
(`soma_pl.io.atomic_folder`). Processes preparing one folder at once (`prepare` commands, the fits of
a sweep's first trials preparing a missing dataset) take turns (`soma_pl.locks.build_lock`): the first
builds, the others then find it up to date, or are refused with one line when it is another build.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from datatrove.pipeline.filters import LambdaFilter

from soma_pl.data.corpus.readers import CorpusKind, corpus_fingerprint, corpus_inputs
from soma_pl.data.formats.manifest import KIND, MANIFEST, existing_fingerprint, read_manifest
from soma_pl.data.preparation.config import PrepareConfig, recipe_config
from soma_pl.data.preparation.steps import (
    FinishPrepare,
    PlanHeldOut,
    ScreenOverlap,
    SelectHeldOut,
    SplitHeldOut,
    WriteShards,
    is_training,
    warn_about,
)
from soma_pl.data.runner.pipeline import chain, corpus_reader, write_paths_file
from soma_pl.data.runner.staging import check_unchanged, remove_staging, run_build
from soma_pl.errors import ConfigError
from soma_pl.io import check_output, read_marker, tag_marker
from soma_pl.locks import build_lock


def prepare(config: PrepareConfig, progress: bool = True, recipe: tuple[str, str] | None = None) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path.

    With a Slurm or Ray executor the stages may still be running when this returns (the output
    then has no manifest yet): run it again once they are done.

    Args:
        recipe: `(recipe file, setting naming the folder)` when a data config builds the folder on
            first use (:func:`prepare_recipe`): another dataset there is then refused unless that
            recipe built it, and the folder's marker records the recipe.

    Raises:
        ConfigError: while this one waited for its turn, another process built a different dataset
            in the folder (`check_unchanged`).
    """
    config.validate()
    output = Path(config.output_dir).expanduser()
    corpus = corpus_fingerprint(config.corpus)
    fingerprint = config.fingerprint(corpus)
    before = existing_fingerprint(output)
    if before == fingerprint:  # up to date: no build, so no lock
        remove_staging(output, "prepare")
        return output
    with build_lock(output, "dataset.output_dir"):  # checked again inside: another process may have built it
        return _prepare(config, progress, recipe, output, corpus, fingerprint, before)


def _prepare(config: PrepareConfig, progress: bool, recipe: tuple[str, str] | None, output: Path, corpus: dict,
             fingerprint: str, before: str | None) -> Path:
    """`prepare` holding the folder; `before`: the fingerprint of what it held before the turn came."""
    started = time.time()
    existing = existing_fingerprint(output)
    if existing == fingerprint:
        remove_staging(output, "prepare")
        return output
    check_unchanged(output, "dataset.output_dir", before, existing, fingerprint)
    if recipe is not None and existing is not None:
        _check_recipe_built(output, existing, fingerprint, *recipe)
    check_output(output, KIND, "dataset.output_dir", corpus_inputs(config.corpus))
    if (output / MANIFEST).is_file():
        warnings.warn(f"{output}: prepared with another config or corpus; rebuilding", stacklevel=2)

    def make_stages(stage: Path) -> list[tuple[str, object]]:
        write_paths_file(config.corpus, stage / "files.txt")
        return _stages(config, stage, fingerprint, corpus, started, progress)

    if not run_build(config.executor, output, "prepare", "dataset.output_dir", fingerprint, make_stages,
                     lambda: existing_fingerprint(output) == fingerprint):
        return output
    warn_about(read_manifest(output))
    remove_staging(output, "prepare")
    if recipe is not None:
        tag_marker(output, recipe=_recipe_id(recipe[0]))
    return output


def _recipe_id(recipe: str | Path) -> str:
    return str(Path(recipe).expanduser().resolve())


def _check_recipe_built(output: Path, existing: str, fingerprint: str, recipe: str, setting: str) -> None:
    """Refuse to rebuild, from `recipe`, a prepared dataset that this recipe did not build (one made
    by `prepare`, or by another recipe): it holds a user's data, which a recipe must never replace."""
    marker = read_marker(output) or {}
    if marker.get("recipe") != _recipe_id(recipe):
        raise ConfigError(f"{setting}={output} holds a prepared dataset (fingerprint {existing[:12]}) that the recipe "
                          f"{recipe} did not build (it builds {fingerprint[:12]}): to use that dataset as it is, set "
                          f"the recipe to null; to build the recipe's, choose another {setting}")


def _stages(config: PrepareConfig, stage: Path, fingerprint: str, corpus: dict, started: float,
            progress: bool) -> list[tuple[str, object]]:
    """The four executors, each depending on the one before: `(name, executor)`."""
    tasks = config.executor.task_count()
    if CorpusKind(config.corpus.kind) is not CorpusKind.demo:
        files = sum(1 for line in (stage / "files.txt").read_text().splitlines() if line)
        tasks = min(tasks, files)  # datatrove deals out whole files: more tasks would idle
    paths = stage / "files.txt"
    write = [corpus_reader(config.corpus, paths, progress), SplitHeldOut(config, stage), ScreenOverlap(config, stage),
             LambdaFilter(is_training), WriteShards(config, stage)]
    pipelines = [("select", [corpus_reader(config.corpus, paths, progress), SelectHeldOut(config, stage)], tasks),
                 ("plan", [PlanHeldOut(config, stage, tasks)], 1),
                 ("write", write, tasks),
                 ("finish", [FinishPrepare(config, stage, tasks, fingerprint, corpus, started)], 1)]
    return chain(config.executor, pipelines, stage, "prepare")


def prepare_recipe(recipe: str | Path, folder: str | Path, setting: str, progress: bool = True) -> Path:
    """Build `folder` (named by the option `setting`) with the `dataset:` section of the data config
    `recipe`: a no-op when the folder already holds that build, a rebuild when this recipe built
    what it holds, and a one-line refusal when anything else built it."""
    return prepare(recipe_config(recipe, folder), progress=progress, recipe=(str(recipe), setting))
