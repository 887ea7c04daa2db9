"""What the gateway and the mock upstream both put on the wire: OpenAI-shaped JSON bodies.

Both speak the OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``, and
on the Messages API the Anthropic one, ``{"type": "error", "error": {"type", "message"}}``;
they live here so that the gateway does not import the test double it is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["anthropic_body", "anthropic_error", "error_response", "json_response"]

ERROR_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "requests"}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


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


def anthropic_body(status: int, body: Any) -> dict[str, Any]:
    """An error body in the Anthropic shape: one already in it is kept, an OpenAI-shaped
    one is converted (its message kept)."""
    if isinstance(body, dict) and body.get("type") == "error":
        return body
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(message or "error")}}


def anthropic_error(
    status: int, message: str, *, headers: Mapping[str, str] | None = None
) -> Response:
    """An Anthropic-shaped error: ``{"type": "error", "error": {"type", "message"}}``."""
    body = anthropic_body(status, {"error": {"message": message}})
    return json_response(body, status, headers)
