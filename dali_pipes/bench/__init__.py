"""Benchmarks and their baselines: what a user would otherwise run, measured side by side."""
