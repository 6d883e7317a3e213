"""Byte-level data: corpus readers, the demo corpus, prepared datasets, shards and DataModules.

Names are imported on first use, so the datatrove tasks of `prepare` and `shard` (fresh processes
that import this package to unpickle their steps) do not pay for Lightning and torch.
"""

from importlib import import_module

_NAMES = {
    "ByteDataModule": "soma_pl.data.datamodule",
    "CorpusConfig": "soma_pl.data.readers",
    "CorpusKind": "soma_pl.data.readers",
    "Document": "soma_pl.data.documents",
    "PrepareConfig": "soma_pl.data.prepare",
    "iter_corpus": "soma_pl.data.readers",
    "prepare": "soma_pl.data.prepare",
    "read_manifest": "soma_pl.data.prepare",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'soma_pl.data' has no attribute '{name}'")
    return getattr(import_module(_NAMES[name]), name)
