"""Benchmarks and measurement scripts (run from the repository root: `python bench/NAME.py`,
`python -m bench.gpu`); a package so that `bench.gpu` is found here before any namesake."""
