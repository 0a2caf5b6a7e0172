"""Benchmarks: `python -m bench.run` (make bench) and the GPU scripts; see bench/run.py."""
