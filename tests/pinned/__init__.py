"""Pinned-loss regression tests: every method's logged losses on a fixed in-memory corpus, and one exact update."""
