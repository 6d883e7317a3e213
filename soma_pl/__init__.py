"""soma_pl: zero-order pretraining of sharded byte-level language models with PyTorch Lightning."""

__version__ = "0.1.0"

WINDOW_BYTES = 1025
"""A training or evaluation window: 1,024 bytes of context plus the next byte (Table 1)."""

ROUTE_BYTES = 256
"""The router reads the first 256 input bytes of a window; the loss scores the rest (Table 1)."""

VOCAB_SIZE = 256
"""Byte vocabulary."""

VAL_WINDOWS = "val_windows"
"""The folder in a fit's log folder (``version_N``) holding each validation window by window:
``<updates>.json`` with ``updates``, ``k``, ``window_index``, ``window_losses`` (the k-expert
ensemble's, nats/byte) and ``doc_ids``: written by the LightningModule, read by the analyses."""
