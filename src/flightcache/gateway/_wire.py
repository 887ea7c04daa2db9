"""What the gateway and the mock upstream both put on the wire: OpenAI-shaped JSON bodies.

Both speak the OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``; it
lives here so that the gateway does not import the test double it is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["error_response", "json_response"]

ERROR_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "requests"}


def json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(data), status, headers, media_type="application/json")


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return json_response(body, status, headers)
