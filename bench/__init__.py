"""Benchmarks: `python -m bench` runs them (see bench/__main__.py)."""
