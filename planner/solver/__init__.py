"""The solver of vbs-serve: per-layer batch sizes within a memory budget (pure Python, numpy,
numba). It runs offline (`vbs plan`, `vbs solve`); what a worker reads of its output, the plan
table and the walk, lives in ``core``.

Modules, one job each:

- ``model``     a Profile flattened into chains of units with boundary sizes, per objective
- ``pricing``   what a program costs: its steps' times plus one call per run
- ``simulate``  the executable statement of what a program means under the model of memory
- ``kernel``    the numba DP kernels (paper and vbs recurrences) and plan read-out
- ``dp``        runs the kernels over a tree (branch chains first) and reads plans out
- ``plain``     the same recurrences in plain Python (cross-check, speed reference)
- ``baselines`` the paper's FBS and Greedy-VBS under the same model
- ``solve``     ``solve(profile, r, budget, solver=...)``: one plan, any solver
- ``tables``    ``build_tables``: every (r, budget) from one solve, as ``core.table.PlanTable``
- ``compare``   every strategy's plans side by side, for `vbs bench` and the page
- ``synthetic`` GoogLeNet-, ResNet-50- and chain-shaped profiles without torch
- ``build_times`` times table builds (``python -m planner.solver.build_times``)
"""
