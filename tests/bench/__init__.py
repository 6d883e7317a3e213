"""Benchmarks (structure only; never timing thresholds)."""
