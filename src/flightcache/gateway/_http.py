"""The HTTP client the gateway calls its upstream with.

``httpx2`` where it installs (Python 3.11 and later): the maintained fork of httpx that the
official ``openai`` and ``anthropic`` SDKs use, whose connection pool stays linear in its
connections. httpcore 1.0's pool (under ``httpx``) rescans every connection once per
connection on each request and release, which doubled the gateway's CPU per stream once
its upstream connections were kept alive. ``httpx`` on Python 3.10, with the same API.
"""

from __future__ import annotations

try:
    import httpx2 as httpx
except ImportError:  # Python 3.10: httpx2 needs 3.11
    import httpx  # type: ignore[no-redef]

__all__ = ["httpx"]
