"""Benchmarks whose tables live in docs/benchmarks.md; each runs as `python -m onpolicy.bench.X`."""
