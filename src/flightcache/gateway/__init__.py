"""HTTP around the library: the OpenAI-compatible gateway and its test double (docs/gateway.md).

Needs the ``gateway`` extra (Starlette, uvicorn, aiohttp): ``pip install 'flightcache[gateway]'``.
The core package never imports this one.

- ``_mock``: ``flightcache mock-upstream``, a test double of an OpenAI-compatible API.
- ``_serve_util``: run an ASGI app under uvicorn (print the address, stop cleanly on SIGTERM),
  in the foreground or in a background thread.
"""
