"""Where documents come from, the lowest stage of `soma_pl.data`: it imports no other stage.

- `documents`: `Document`, the unit every reader yields (UTF-8 bytes and provenance).
- `readers`: `CorpusConfig` and the readers of parquet, JSONL and text corpora; a corpus's identity.
- `demo`: the built-in demo corpus (three genres fetched with package clients, pinned by sha256).
- `external`: the pinned external text of frozen evaluation (Table 9) and its `external-text` command.
"""
