"""Benchmarks: ``make bench`` runs them all; each prints ratios against a same-run baseline."""
