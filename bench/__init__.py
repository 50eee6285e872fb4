"""Benchmarks and measurement scripts (run from the repository root: `python bench/NAME.py`,
`python -m bench.gpu`); a package so that `bench.gpu` is found here before any namesake.
What the scripts share (a free port, a server started, waited on and stopped, a .npy body)
is in served.py; bench/gpu/ keeps its own, being installed alone."""
