"""The prepared dataset folder on disk: its manifest's name and format, and reading it back.

`prepare` (`soma_pl.data.preparation`) writes the folder; the DataModule, `shard`, the benchmarks and
the analyses read it through these functions. A folder whose manifest is missing, unreadable or of
another format, or names a path outside the folder, is refused with one line naming it; an
evaluation set whose sha256 is not the recorded one too.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePath

from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.tar_shards import sha256_file
from soma_pl.errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSION = 5
KIND = "prepared dataset"
"""What the output folder's marker calls it (`soma_pl.io.OUTPUT_MARKER`)."""


def existing_fingerprint(output: Path) -> str | None:
    """The fingerprint of the prepared folder at `output`, or None (none there, or its manifest is
    unusable: a rebuild replaces it)."""
    try:
        return read_manifest(output).get("fingerprint")
    except DataError:
        return None


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


def outside(path) -> bool:
    """Whether a path a manifest names could lead out of its dataset folder: not a string, empty,
    absolute, or through `..`. Readers join it to the folder, so it must stay inside."""
    return not isinstance(path, str) or not path or PurePath(path).is_absolute() or ".." in PurePath(path).parts


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
            paths = [record["path"] for record in shards]
        elif not (isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)):
            return f"no file and sha256 named under `{key}`"
        else:
            paths = [entry["file"]]
        escaping = next((path for path in paths if outside(path)), None)
        if escaping is not None:
            return f"`{key}` names {escaping!r}, a path outside the dataset folder"
    return None


def load_eval_set(folder: str | Path, manifest: dict, key: str) -> EvalSet:
    """The evaluation windows the manifest entry `key` (`ensemble_val`, `test`, `test_final`) names,
    checked against the sha256 recorded when they were written.

    Raises:
        DataError: the file is missing, corrupt, or not the one the manifest recorded.
    """
    entry = manifest[key]
    path = Path(folder) / entry["file"]
    if path.is_file() and sha256_file(path) != entry["sha256"]:
        raise DataError(f"altered evaluation set {path}: sha256 differs from the manifest; run prepare again")
    return EvalSet.load(path)


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
