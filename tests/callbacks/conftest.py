"""Reuse the tiny corpus of the `fit` tests."""

from tests.lit.conftest import corpus_dir  # noqa: F401
