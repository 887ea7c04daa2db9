"""Benchmarks of flightcache: ``python -m bench`` (see bench/README.md)."""
