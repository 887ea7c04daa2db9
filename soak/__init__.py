"""A fault soak of flightcache with a checker (``python -m soak``, ``make soak``).

Worker processes (``worker.py``) call ``do()``, ``get()``, ``stream()``, ``invalidate()``
and ``set()`` on a few keys and record every operation and every loader run
(``records.py``); a seeded nemesis (``nemesis.py``) kills and stops them, restarts or fails
over the server (``servers.py``) and cuts or slows their links (``proxy.py``); afterwards
the checker (``checker.py``) reads every record and reports violations. ``mutants.py``
holds deliberately broken builds that the checker must catch. ``run.py`` ties them together.
"""
