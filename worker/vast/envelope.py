"""The Vast request envelope: the body `{auth_data, payload, session_id}` (backend.py `Backend.__handle_request`),
a bad shape being 422, and the keys under which an admitted request's parts are stored on the aiohttp request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

# Request storage keys (web.RequestKey where aiohttp has it, else the plain string):
_RequestKey = getattr(web, "RequestKey", None)
OPENAI_BODY: Any = _RequestKey("openai_body", object) if _RequestKey else "openai_body"  # the body to serve
VAST_REQUEST: Any = _RequestKey("vast_request", object) if _RequestKey else "vast_request"  # its RequestRecord


@dataclass(frozen=True)
class AuthData:
    """The route reply the client forwards (data_types.AuthData); every field is required, as there."""

    cost: Any
    endpoint: Any
    reqnum: int
    request_idx: int
    signature: Any
    url: Any

    @classmethod
    def parse(cls, value: Any) -> "AuthData":
        if not isinstance(value, dict):
            raise EnvelopeError({"auth_data": "must be an object"})
        errors = {name: "missing parameter" for name in cls.__dataclass_fields__ if name not in value}
        ints: dict[str, int] = {}
        for name in ("reqnum", "request_idx"):
            if name in value:
                try:
                    ints[name] = int(value[name])
                except (TypeError, ValueError):
                    errors[name] = "must be an integer"
        if errors:
            raise EnvelopeError({"auth_data": errors})
        return cls(cost=value["cost"], endpoint=value["endpoint"], signature=value["signature"], url=value["url"],
                   **ints)


class EnvelopeError(Exception):
    """A malformed `{auth_data, payload}` body: 422 with the framework's error dict as the body."""

    def __init__(self, errors: dict[str, Any]) -> None:
        super().__init__(json.dumps(errors))
        self.errors = errors


def parse_envelope(data: dict[str, Any]) -> tuple[AuthData, dict[str, Any], Any]:
    """(auth_data, OpenAI payload, session_id) of a Vast request, as data_types.EndpointHandler.get_data_from_request
    reads it; a payload wrapped as `{"input": {...}}` (the reference OpenAI worker's request_parser) is unwrapped."""
    errors: dict[str, Any] = {}
    auth = None
    try:
        auth = AuthData.parse(data["auth_data"]) if "auth_data" in data else None
        if auth is None:
            errors["auth_data"] = "field missing"
    except EnvelopeError as exc:
        errors.update(exc.errors)
    payload = data.get("payload")
    if "payload" not in data:
        errors["payload"] = "field missing"
    elif not isinstance(payload, dict):
        errors["payload"] = {"data": "payload must be a dictionary"}
    elif isinstance(payload.get("input"), dict):
        payload = payload["input"]
    if errors:
        raise EnvelopeError(errors)
    return auth, payload, data.get("session_id")
