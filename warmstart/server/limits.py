"""Request body size limit (--max-request-bytes), enforced before any byte is parsed.

A declared Content-Length over the limit is answered 413 at once, without reading the body; a chunked body is
counted as it arrives and fails with the same 413 the moment it crosses the limit, so no handler ever holds more
than the limit in memory or hands it to the JSON parser."""
from __future__ import annotations

import json

from warmstart.config import format_bytes
from warmstart.server.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20      # generous: a 128k-token prompt as JSON is well under 2 MiB


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f" ({format_bytes(size)})" if size is not None else ""
    return APIError(413, f"The request body{got} is larger than this server's limit of {format_bytes(limit)} "
                         "(--max-request-bytes).", "invalid_request_error", code="request_too_large")


class BodyLimit:
    """Pure ASGI middleware (streaming-safe)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            err = too_large(self.max_bytes, declared)
            body = json.dumps(err.body()).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)        # the app's APIError handler answers 413
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
