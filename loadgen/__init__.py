"""The load generator behind ``vbs loadtest``: a room of its own beside ``service/``.

It is a client, not the server: it sends requests to a `vbs serve` (or to Triton) over HTTP and
the Open Inference Protocol's gRPC, and measures the answers, so nothing of the server belongs
in it and it must not slow the server's import or grow with it. It may import ``core`` (for
``core.errors.UsageError``) and ``service.oip`` (the generated OIP v2 stubs) and nothing else
of this repository; the only way in from the rooms below is `vbs loadtest`'s dispatch in
``service/cli.py`` (``tests/test_layout.py`` checks both).

- ``loadtest``: clients in this process over HTTP (closed loop), the summary and its table;
- ``loadtest_grpc``: the same over gRPC;
- ``processes``: ``--processes``, client processes (``child``) sending requests encoded
  beforehand (``wire``), closed or open loop;
- ``cli``: which of them `vbs loadtest`'s flags ask for.
"""
