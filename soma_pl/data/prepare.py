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

The stages (`soma_pl.data.prepare_steps`) run on the executor of `dataset.executor` (local by
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
(`soma_pl.io.atomic_folder`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from soma_pl import WINDOW_BYTES
from soma_pl.data.pipeline import ExecutorConfig, chain, corpus_reader, write_paths_file
from soma_pl.data.readers import CorpusConfig, CorpusKind, corpus_fingerprint
from soma_pl.data.staging import build_lock, remove_staging, run_build
from soma_pl.errors import ConfigError, DataError
from soma_pl.io import check_output, read_marker, tag_marker

MANIFEST = "manifest.json"
FORMAT_VERSION = 4
KIND = "prepared dataset"
"""What the output folder's marker calls it (`soma_pl.io.OUTPUT_MARKER`)."""


@dataclass
class PrepareConfig:
    """What `prepare` builds, and where.

    Attributes:
        corpus: the documents to read.
        output_dir: the prepared dataset folder.
        seed: decides which documents are held out.
        val_documents: held-out documents for ensemble validation (paper: 202).
        val_windows: ensemble-validation windows taken round-robin from them (paper: 976).
        test_windows: test documents, one window each, after the overlap screen (paper: 4,096).
        final_test_windows: documents of the final test split, one window each, screened like the
            test ones: a second test split that no development result touches, reported only by
            the final runs of a reproduction (0: none; `test` holds the same documents either way).
        test_oversample: test candidates held out per test window wanted (test and final test
            together), to absorb exclusions.
        shingle_bytes: a test candidate sharing a substring this long with a training document is
            excluded.
        shard_max_bytes: a training shard is cut once it reaches this size.
        expert_val_fraction: share of the training documents held out as the expert-validation
            split that drives a monolithic model's learning-rate decay (paper: 1%).
        executor: how the datatrove pipeline runs (local tasks x workers, Slurm, Ray); it does not
            change which documents go where, so it is not part of the fingerprint.
    """

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    output_dir: str = "data/demo"
    seed: int = 0
    val_documents: int = 202
    val_windows: int = 976
    test_windows: int = 4096
    final_test_windows: int = 0
    test_oversample: float = 1.25
    shingle_bytes: int = 50
    shard_max_bytes: int = 64_000_000
    expert_val_fraction: float = 0.01
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    @property
    def test_candidates(self) -> int:
        """Held-out candidates of both test splits."""
        return math.ceil((self.test_windows + self.final_test_windows) * self.test_oversample)

    @property
    def test_own_candidates(self) -> int:
        """The first candidates (in held-out rank order): the ones `test` draws from, the same with or
        without a final split."""
        return math.ceil(self.test_windows * self.test_oversample)

    def fingerprint(self, corpus: dict | None = None) -> str:
        """Hash of everything the output depends on: settings, corpus identity (`corpus`, when
        already read by `corpus_fingerprint`), format."""
        settings = asdict(self)
        settings.pop("output_dir")
        settings.pop("executor")
        if not self.final_test_windows:  # absent at 0: a folder without a final split keeps its fingerprint
            settings.pop("final_test_windows")
        corpus = corpus_fingerprint(self.corpus) if corpus is None else corpus
        identity = {"settings": settings, "corpus": corpus, "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()

    def validate(self) -> None:
        """Refuse settings that cannot build a usable dataset, naming the key (`dataset.<field>`).

        Raises:
            ConfigError: a count below 1 (`final_test_windows` below 0), an oversampling below 1, a
                shingle longer than a test window (it could never exclude anything) or a fraction
                outside (0, 1).
        """
        counts = {"val_documents": self.val_documents, "val_windows": self.val_windows,
                  "test_windows": self.test_windows, "shard_max_bytes": self.shard_max_bytes}
        for key, value in counts.items():
            if value < 1:
                raise ConfigError(f"dataset.{key}={value} must be >= 1")
        if self.final_test_windows < 0:
            raise ConfigError(f"dataset.final_test_windows={self.final_test_windows} must be >= 0 (0: no final split)")
        if not (math.isfinite(self.test_oversample) and self.test_oversample >= 1):
            raise ConfigError(f"dataset.test_oversample={self.test_oversample} must be a finite number >= 1")
        if not 1 <= self.shingle_bytes <= WINDOW_BYTES:
            raise ConfigError(f"dataset.shingle_bytes={self.shingle_bytes} must be in [1, {WINDOW_BYTES}] "
                              f"(a test window's length)")
        if not 0 < self.expert_val_fraction < 1:
            raise ConfigError(f"dataset.expert_val_fraction={self.expert_val_fraction} must be in (0, 1)")
        self.executor.validate("dataset")


def prepare(config: PrepareConfig, progress: bool = True, recipe: tuple[str, str] | None = None) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path.

    With a Slurm or Ray executor the stages may still be running when this returns (the output
    then has no manifest yet): run it again once they are done.

    Args:
        recipe: `(recipe file, setting naming the folder)` when a data config builds the folder on
            first use (:func:`prepare_recipe`): another dataset there is then refused unless that
            recipe built it, and the folder's marker records the recipe.
    """
    config.validate()
    output = Path(config.output_dir).expanduser()
    corpus = corpus_fingerprint(config.corpus)
    fingerprint = config.fingerprint(corpus)
    if existing_fingerprint(output) == fingerprint:  # up to date: no build, so no lock
        remove_staging(output, "prepare")
        return output
    with build_lock(output, "prepare"):  # checked again inside: another process may have built it
        return _prepare(config, progress, recipe, output, corpus, fingerprint)


def _prepare(config: PrepareConfig, progress: bool, recipe: tuple[str, str] | None, output: Path, corpus: dict,
             fingerprint: str) -> Path:
    """`prepare` under the folder's build lock."""
    started = time.time()
    existing = existing_fingerprint(output)
    if existing == fingerprint:
        remove_staging(output, "prepare")
        return output
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
    from soma_pl.data.prepare_steps import warn_about

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
    from soma_pl.data.prepare_steps import FinishPrepare, PlanHeldOut, SelectHeldOut, WriteShards

    tasks = config.executor.task_count()
    if CorpusKind(config.corpus.kind) is not CorpusKind.demo:
        files = sum(1 for line in (stage / "files.txt").read_text().splitlines() if line)
        tasks = min(tasks, files)  # datatrove deals out whole files: more tasks would idle
    paths = stage / "files.txt"
    pipelines = [("select", [corpus_reader(config.corpus, paths, progress), SelectHeldOut(config, stage)], tasks),
                 ("plan", [PlanHeldOut(config, stage, tasks)], 1),
                 ("write", [corpus_reader(config.corpus, paths, progress), WriteShards(config, stage)], tasks),
                 ("finish", [FinishPrepare(config, stage, tasks, fingerprint, corpus, started)], 1)]
    return chain(config.executor, pipelines, stage, "prepare")


def existing_fingerprint(output: Path) -> str | None:
    """The fingerprint of the prepared folder at `output`, or None (none there, or its manifest is
    unusable: a rebuild replaces it)."""
    try:
        return read_manifest(output).get("fingerprint")
    except DataError:
        return None


def config_json(config: PrepareConfig) -> dict:
    """The config as plain JSON (what the manifest records)."""
    return json.loads(json.dumps(asdict(config), default=str))


def read_manifest(folder: Path) -> dict:
    """The manifest of a prepared folder.

    Raises:
        DataError: the folder or its manifest is missing, unreadable, or lacks an entry that readers
            of a prepared dataset use.
    """
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DataError(f"not a prepared dataset (no {MANIFEST}): {folder}") from error
    except (OSError, ValueError) as error:
        raise DataError(f"unreadable manifest {path}: {error}") from error
    problem = manifest_problem(manifest)
    if problem:
        raise DataError(f"unreadable manifest {path}: {problem}; run prepare again")
    return manifest


SHARD_FIELDS = {"path", "sha256", "bytes", "documents"}
"""What a shard record of the manifest holds (`ShardRecord`)."""


def manifest_problem(manifest) -> str | None:
    """What makes `manifest` unusable as a prepared dataset's, or None. `expert_val` may be
    missing (an older format, refused with its own line where it is needed), and so may `test_final`
    (a dataset prepared without `final_test_windows`)."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    for key in ("train", "expert_val", "ensemble_val", "test", "test_final"):
        entry = manifest.get(key)
        if entry is None and key in ("expert_val", "test_final"):
            continue
        if not isinstance(entry, dict):
            return f"no `{key}` entry"
        if key in ("train", "expert_val"):
            shards = entry.get("shards")
            if not (isinstance(shards, list) and all(isinstance(r, dict) and set(r) == SHARD_FIELDS for r in shards)):
                return f"no list of shard records under `{key}`"
        elif not isinstance(entry.get("file"), str):
            return f"no file named under `{key}`"
    return None


def corpus_inputs(corpus: CorpusConfig) -> list[str]:
    """The paths a corpus is read from (none for the demo corpus): no output may hold them."""
    return [] if CorpusKind(corpus.kind) is CorpusKind.demo else list(corpus.paths)




def load_prepare_config(recipe: str | Path) -> PrepareConfig:
    """The `dataset:` section of a data config (`configs/data/<name>.yaml`).

    Raises:
        ConfigError: the file is missing or its `dataset:` section does not parse.
    """
    from jsonargparse import ArgumentParser

    path = Path(recipe).expanduser()
    if not path.is_file():
        raise ConfigError(f"data config not found: {path}")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--dataset", type=PrepareConfig)
    try:
        return parser.instantiate_classes(parser.parse_path(str(path))).dataset
    except Exception as error:  # jsonargparse reports every parse problem its own way
        raise ConfigError(f"{path}: {str(error).strip().splitlines()[0]}") from error


def prepare_recipe(recipe: str | Path, folder: str | Path, setting: str, progress: bool = True) -> Path:
    """Build `folder` (named by the option `setting`) with the `dataset:` section of the data config
    `recipe`: a no-op when the folder already holds that build, a rebuild when this recipe built
    what it holds, and a one-line refusal when anything else built it."""
    config = load_prepare_config(recipe)
    config.output_dir = str(folder)
    return prepare(config, progress=progress, recipe=(str(recipe), setting))


def open_prepared(folder: str | Path, setting: str) -> dict:
    """The manifest of the prepared folder `folder`, refused with one line when it is missing or
    was written by another format of `prepare` (`setting` names the option for the message)."""
    try:
        manifest = read_manifest(Path(folder).expanduser())
    except DataError as error:
        if not isinstance(error.__cause__, FileNotFoundError):
            raise DataError(f"{setting}={folder}: {error}") from error
        raise DataError(f"{setting}={folder}: {error}; build it first (python -m soma_pl.cli prepare "
                        "--config configs/data/<name>.yaml)") from error
    if manifest.get("format") != FORMAT_VERSION or "fingerprint" not in manifest:
        raise DataError(f"{setting}={folder} was prepared by another soma_pl version (format "
                        f"{manifest.get('format')}, this one reads {FORMAT_VERSION}): run prepare again")
    return manifest
