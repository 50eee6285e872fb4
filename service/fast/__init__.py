"""The fast path: the inference routes served with fewer of the framework's layers, fenced here.

What it does (``VBS_FAST_PATH``, default true; false serves the same routes through plain
FastAPI routes and stock uvicorn, and answers the same: tests/service/fast/test_fast_path.py):

- ``app``       ``FastPathApp``: FastAPI whose ``LeanRoute`` POST routes are matched first and
                run in a stack built from the app's own middleware and exception handlers.
- ``route``     ``LeanRoute``: a route FastAPI documents as any other but calls directly,
                without solving dependencies; ``plain`` turns them back into ``APIRoute``s.
- ``body``      the body read from the ASGI messages, refused at its limit while it arrives.
- ``protocol``  ``HttpProtocol``: uvicorn's httptools protocol sending a response's head and
                body in one write.

What it relies on that Starlette, FastAPI and uvicorn do not document as public (check these
when a floor in pyproject.toml moves; the lowest allowed releases are tested in CI):

- Starlette ``Request._body``: where ``Request.body()`` caches the body, read by ``form()``.
- Starlette ``Starlette.user_middleware``, ``Starlette.exception_handlers`` (their layout:
  ``(cls, args, kwargs)`` triples; handlers keyed by status code or exception class),
  ``starlette.routing.compile_path`` and ``Convertor.convert``, the scope keys ``app``,
  ``router``, ``route``, ``endpoint``, ``path_params`` that routing sets, and the
  ``max_body_size`` attribute (when set, the app's own body limit: the fast path stands aside).
- FastAPI ``APIRoute.dependant`` (``Dependant``'s ``query_params``, ``header_params``,
  ``cookie_params``, ``body_params``, ``path_params``, ``dependencies``,
  ``request_param_name``) and ``APIRoute.get_route_handler`` (a customisation point).
- uvicorn ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` (its
  ``connection_made`` and ``loop``), and the status line and header block it writes
  (``HTTP/1.1 `` ... ``\r\n\r\n``) in one ``write`` call before the body.
"""
