"""The floor under the planner and the workers: what both need to run a plan.

- ``errors``    the one exception tree of vbs-serve
- ``tree``      the division tree and the profile (``vbs.profile/1``), no torch
- ``sizes``     byte sizes: parse and format (``30MB``, ``2GiB``), allocation granules, slots
- ``shapes``    per-sample shape text (``3,224,224``) read by one rule
- ``lru``       the one bounded least-recently-used cache
- ``loaded``    ``ModelSpec`` and ``LoadedModel``: a model as it is passed around
- ``cuda_allocator`` the caching allocator set to split blocks exactly (claims hold on CUDA)
- ``units``     ``Capture``: the tree with what runs each unit (``Unit``) and join (``Join``)
- ``runner``    runs a unit, a subtree or the whole captured model on torch
- ``runtimes``  the unit runtimes (torch, ONNX Runtime sessions over exported units)
- ``program``   ``Step``, ``Program``, ``Plan``: what a plan is, with its JSON form
- ``runs``      runs of steps one runtime call executes, and the tree index they need
- ``walk``      the executor's walk over a program, with a byte-counting and a running back end
- ``table``     ``PlanTable``: the read side of the plan tables (a binary search per batch)

Nothing here imports ``planner``, ``workers`` or ``service``, nor numba or the DP: a worker
that serves reads tables and walks plans, it never solves.
"""
