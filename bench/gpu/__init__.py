"""The GPU run: every GPU code path of vbs-serve measured in one prepared command (`make gpu`).

A GPU machine is lent now and then, for minutes, with no package registry. So the run is a
few steps, run in device calls that each install the project from carried wheels and leave
their results as JSON in out/gpu/ (and in the device tool's $OUT): ``smoke`` (CUDA graphs
captured in the bench's and the profiler's orders; when it fails the call stops), ``tests``
(pytest -m gpu, the core, planner and workers suites), ``profile`` (vbs profile of the paper's
models, float32 and float16), ``bench`` (vbs bench of every strategy against budgets, with the paper's Table
II beside it), ``energy`` (tables planned for energy beside tables for time, from NVML),
``serve`` (vbs serve under vbs loadtest with vbs and fbs-best tables, then while another
process gives device memory back in steps), and ``summary`` (summary.md, the tables for
docs/benchmarks.md). `make gpu DEVICE=cpu QUICK=1` runs every step on the CPU with small
models, in CI, so that what reaches the GPU has already run; its figures are not GPU results
and its summary says so first. docs/gpu.md has the device calls.
"""
