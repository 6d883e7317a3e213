"""soma_pl: zero-order pretraining of sharded byte-level language models with PyTorch Lightning."""

__version__ = "0.1.0"

WINDOW_BYTES = 1025
"""A training or evaluation window: 1,024 bytes of context plus the next byte (Table 1)."""

ROUTE_BYTES = 256
"""The router reads the first 256 input bytes of a window; the loss scores the rest (Table 1)."""

VOCAB_SIZE = 256
"""Byte vocabulary."""
