"""API key check as pure ASGI middleware (streaming-safe): every route but the open ones needs
"Authorization: Bearer <key>", compared in constant time; a miss is a 401 in OpenAI's error shape. CORS
preflights (OPTIONS with an Origin) pass through to the CORS middleware, which answers them without a key, as
browsers never send credentials on a preflight."""
from __future__ import annotations

import hmac
import json


class RequireKey:
    def __init__(self, app, key: str, open_routes: tuple[str, ...]):
        self.app, self.open_routes = app, frozenset(open_routes)
        self._key = key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in self.open_routes or self._preflight(scope) \
                or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest takes time independent of where the bytes differ.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    @staticmethod
    def _preflight(scope) -> bool:
        if scope.get("method") != "OPTIONS":
            return False
        names = {name for name, _ in scope.get("headers", ())}
        return b"origin" in names and b"access-control-request-method" in names
