"""carpool's HTTP/1.1 server: one asyncio protocol on ``httptools``' parser, owned here.

::

    socket ─► server.py      accept in bursts, first bytes read at once; stop and drain
           ─► connection.py  framing (parser callbacks, repeated heads), order, answers,
                             keep-alive, flow control, refusals, lingering close
           ─► dispatch.py    the infer fast path (no task) | probes | a route's handler
           ─► router.py      the one router: method and path to a route (401/404/405/501)
           ─► handlers.py    a route's answer: codec (server/infer.py), batcher, replica

Beside them: ``headers.py`` (the one header reader), ``body.py`` (the one body check),
``guards.py`` (head limits, read-ahead, the wait timer), ``refusals.py``, ``answer.py``
(status lines, heads, chunks, the date), ``repeats.py``, ``exchange.py``. The same router,
handlers, header reader and body check serve :class:`carpool.server.app.KServeApp` when it
is mounted as a plain ASGI app instead.

The package imports nothing itself: :mod:`carpool.server.app` imports its router and
handlers, and :mod:`~carpool.server.http.server` imports the app.
"""
