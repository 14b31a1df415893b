"""Benchmarks: ``python -m benchmarks.{transfer,serving,proxy}``; ``--full`` for the sweep."""
