"""Byte-level data, by stage; each sub-package imports only from those listed before it:

- `corpus`: the document, corpus readers (parquet, JSONL, text), the demo corpus, the external text.
- `formats`: what is on disk: WebDataset tar shards, evaluation windows, the prepared folder's
  manifest, the sharded folder's `experts.json`.
- `runner`: the datatrove plumbing of `prepare` and `shard`: executors (local, Slurm, Ray), corpus
  reader steps, the staging folder, the files tasks hand each other.
- `preparation`: `prepare` (its config, held-out choice, stages and command).
- `sharding`: `shard` (its config, expert assignment, stages and command).
- `training`: the training-time `ByteDataModule` and its window stream.

Names are imported on first use, so the datatrove tasks of `prepare` and `shard` (fresh processes
that import this package to unpickle their steps) do not pay for Lightning and torch.
"""

from importlib import import_module

_NAMES = {
    "ByteDataModule": "soma_pl.data.training.datamodule",
    "CorpusConfig": "soma_pl.data.corpus.readers",
    "CorpusKind": "soma_pl.data.corpus.readers",
    "Document": "soma_pl.data.corpus.documents",
    "PrepareConfig": "soma_pl.data.preparation.config",
    "iter_corpus": "soma_pl.data.corpus.readers",
    "prepare": "soma_pl.data.preparation.prepare",
    "read_manifest": "soma_pl.data.formats.manifest",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'soma_pl.data' has no attribute '{name}'")
    return getattr(import_module(_NAMES[name]), name)
