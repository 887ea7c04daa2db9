"""What the wrappers need to know of a Stainless-generated SDK (``openai``, ``anthropic``).

Both SDKs share one design: ``NotGiven`` / ``Omit`` for absent arguments, pydantic models
built from the API's JSON without validation by ``_models.construct_type`` (the function
the SDK itself uses, so an answer rebuilt from the cache is the object the SDK would have
returned), ``to_dict()`` for the JSON back, and one exception tree (``APIStatusError`` and
its subclasses chosen by the client's ``_make_status_error``, ``APIConnectionError``,
``APITimeoutError``, ``APIError``) whose objects carry the HTTP response of the SDK's own
HTTP library. :class:`Sdk` wraps one such module.

An error is fanned out to the callers of a flight in other processes as a
``RemoteError`` whose ``data`` is the error's description (:meth:`Sdk.describe`: kind,
status, body, message, the headers a caller needs); :meth:`Sdk.rebuild` makes the SDK's
exception of the same class from it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import RemoteError

__all__ = ["Sdk", "Unkeyable"]

KEPT_HEADERS = ("retry-after", "retry-after-ms", "x-request-id", "request-id")
KEPT_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")


class Unkeyable(TypeError):
    """An argument that has no JSON form, so the call has no key (it goes to the SDK)."""


class Sdk:
    """One SDK module (``openai`` or ``anthropic``) as the wrappers use it."""

    def __init__(self, module: types.ModuleType) -> None:
        self.name = module.__name__
        models = getattr(module, "_models", None)
        self._construct = getattr(models, "construct_type", None)
        self._absent = tuple(
            cls for cls in (getattr(module, "NotGiven", None), getattr(module, "Omit", None)) if cls
        )
        self.APIError: type[Exception] = module.APIError
        self.APIStatusError: type[Exception] = module.APIStatusError
        self.APIConnectionError: type[Exception] = module.APIConnectionError
        self.APITimeoutError: type[Exception] = module.APITimeoutError
        exceptions = vars(getattr(module, "_exceptions", module))
        self._http: Any = exceptions.get("httpx2") or exceptions.get("httpx")
        self._unions: dict[Any, dict[str, Any] | None] = {}

    # -- values -------------------------------------------------------------------------------

    def is_given(self, value: Any) -> bool:
        return not isinstance(value, self._absent)

    def jsonable(self, value: Any) -> Any:
        """An argument's JSON form, as the SDK would send it (absent values dropped)."""
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        if isinstance(value, Mapping):
            return {str(k): self.jsonable(v) for k, v in value.items() if self.is_given(v)}
        if hasattr(value, "model_dump"):  # a pydantic model, an SDK answer type among them
            return value.model_dump(mode="json", exclude_unset=True, by_alias=True)
        if isinstance(value, (bytes, bytearray, memoryview)):
            raise Unkeyable(f"{type(value).__name__} arguments have no JSON form")
        if isinstance(value, Iterable):  # a list, a tuple, a generator of messages
            return [self.jsonable(v) for v in value]
        raise Unkeyable(f"{type(value).__name__} arguments have no JSON form")

    def dump(self, obj: Any) -> Any:
        """An SDK object's JSON, as the API sent it (fields it did not send left out)."""
        to_dict = getattr(obj, "to_dict", None)
        if to_dict is not None:
            return to_dict(mode="json")
        if hasattr(obj, "model_dump"):
            return obj.model_dump(mode="json", exclude_unset=True, by_alias=True)
        return obj

    def _members(self, kind: Any) -> dict[str, Any] | None:
        """A union of event types by their ``type`` literal (``ResponseStreamEvent`` has
        about fifty members: resolving it member by member costs ten times the build)."""
        if kind in self._unions:
            return self._unions[kind]
        args = typing.get_args(kind)
        if typing.get_origin(kind) is typing.Annotated:
            args = typing.get_args(args[0])
        mapping: dict[str, Any] | None = {}
        for member in args:
            fields = getattr(member, "model_fields", None)
            field = fields.get("type") if isinstance(fields, dict) else None
            values = typing.get_args(field.annotation) if field is not None else ()
            if mapping is None or not values or not all(isinstance(v, str) for v in values):
                mapping = None
                break
            mapping.update(dict.fromkeys(values, member))
        self._unions[kind] = mapping or None
        return mapping or None

    def build(self, kind: Any, data: Any) -> Any:
        """The SDK's object of type ``kind`` for ``data``, built as the SDK builds it."""
        if self._construct is not None:
            members = self._members(kind) if isinstance(data, dict) else None
            if members is not None and data.get("type") in members:
                kind = members[data["type"]]
            return self._construct(value=data, type_=kind)
        from pydantic import TypeAdapter  # an SDK without construct_type: validate

        return TypeAdapter(kind).validate_python(data)

    # -- errors -------------------------------------------------------------------------------

    def _request(self, client: Any) -> Any:
        return self._http.Request("POST", str(getattr(client, "base_url", "http://upstream")))

    def status_error(
        self,
        client: Any,
        status: int,
        body: Any,
        headers: Mapping[str, str] | None = None,
        message: str | None = None,
    ) -> Exception:
        """The SDK's exception for an HTTP error (its class chosen by the status)."""
        response = self._http.Response(
            status, headers=dict(headers or {}), json=body, request=self._request(client)
        )
        text = message or f"Error code: {status} - {body}"
        make = getattr(client, "_make_status_error", None)
        if make is not None:
            error: Exception = make(text, body=body, response=response)
            return error
        return self.APIStatusError(text, response=response, body=body)  # type: ignore[call-arg]

    def describe(self, exc: BaseException) -> dict[str, Any] | None:
        """The JSON description of an SDK error that :meth:`rebuild` takes, or None."""
        message = str(getattr(exc, "message", "") or exc)
        body = getattr(exc, "body", None)
        try:
            body = self.jsonable(body)
        except Unkeyable:
            body = None
        if isinstance(exc, self.APIStatusError):
            response = getattr(exc, "response", None)
            given = getattr(response, "headers", None) or {}
            headers = {
                str(k).lower(): str(v)
                for k, v in given.items()
                if str(k).lower() in KEPT_HEADERS or str(k).lower().startswith(KEPT_PREFIXES)
            }
            status = getattr(exc, "status_code", 500)
            return {"sdk": self.name, "kind": "status", "status": status, "body": body} | {
                "message": message,
                "headers": headers,
            }
        if isinstance(exc, self.APITimeoutError):
            return {"sdk": self.name, "kind": "timeout", "message": message}
        if isinstance(exc, self.APIConnectionError):
            return {"sdk": self.name, "kind": "connection", "message": message}
        if isinstance(exc, self.APIError):
            return {"sdk": self.name, "kind": "api", "message": message, "body": body}
        return None

    def mark(self, exc: BaseException) -> None:
        """Make a flight's error reach every caller, never stored: its description for
        other processes, and no negative caching."""
        try:
            details = self.describe(exc)
            if details is not None:
                exc.flightcache_data = details  # type: ignore[attr-defined]
            exc.flightcache_error_ttl = 0  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # an exception that takes no attributes
            pass

    def rebuild(self, client: Any, remote: RemoteError) -> Exception | None:
        """The SDK's exception for an error of another process's flight, or None."""
        data = remote.data
        if not isinstance(data, dict) or data.get("sdk") != self.name:
            return None
        kind = data.get("kind")
        message = str(data.get("message") or remote.remote_message)
        request = self._request(client)
        if kind == "status" and isinstance(data.get("status"), int):
            headers = data.get("headers") if isinstance(data.get("headers"), dict) else {}
            return self.status_error(client, data["status"], data.get("body"), headers, message)
        if kind == "timeout":
            return self.APITimeoutError(request=request)  # type: ignore[call-arg]
        if kind == "connection":
            return self.APIConnectionError(message=message, request=request)  # type: ignore[call-arg]
        if kind == "api":
            return self.APIError(message, request, body=data.get("body"))  # type: ignore[call-arg]
        return None
