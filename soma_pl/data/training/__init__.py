"""Training-time data, the top stage of `soma_pl.data`: the `ByteDataModule` and its window stream.

- `stream`: `WindowStream`, `[E, B, 1025]` training windows streamed from tar shards, and fixed windows.
- `datamodule`: `ByteDataModule`, training, expert-validation, ensemble-validation and test loaders.
"""
