"""Byte-level data: corpus readers, the demo corpus, prepared datasets, shards and DataModules."""

from soma_pl.data.datamodule import ByteDataModule
from soma_pl.data.documents import Document
from soma_pl.data.prepare import PrepareConfig, prepare, read_manifest
from soma_pl.data.readers import CorpusConfig, CorpusKind, iter_corpus

__all__ = ["ByteDataModule", "CorpusConfig", "CorpusKind", "Document", "PrepareConfig", "iter_corpus",
           "prepare", "read_manifest"]
