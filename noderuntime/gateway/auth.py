"""API keys: checked before anything else, in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from noderuntime.gateway.errors import ApiError, error_response

# paths outside /v1/ that need a key too: what llama-server names them
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


def _bearer(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """The token of an ``Authorization: Bearer ...`` header (the scheme in any case), or b""."""
    auth = dict(headers).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class ApiKeys:
    """ASGI middleware: a ``/v1/`` request without a valid key is answered 401 first.

    Before its body is read or checked, so that a client without a key learns that,
    not what else is wrong with its request. No keys configured: everyone is let in.
    """

    def __init__(self, app: Any, keys: Collection[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)  # lifespan events have no path
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))  # mounted under a prefix: its own path
        # a browser's CORS preflight carries no credentials, by the fetch standard
        if (path.startswith("/v1/") or path in _KEYED_PATHS) and scope.get("method") != "OPTIONS":
            given = _bearer(scope.get("headers") or ())
            # compare every key in constant time: how long a refusal takes says nothing of a key
            matched = [hmac.compare_digest(given, key) for key in self.keys]
            if not sum(matched):
                refusal = ApiError(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    "authentication_error",
                    "invalid_api_key",
                )
                await error_response(refusal)(scope, receive, send)
                return
            # whoever holds a key is that key, however its header was spelled (scheme case, spaces)
            scope[CLIENT_KEY] = key_identity(self.keys[matched.index(True)])
        await self.app(scope, receive, send)


CLIENT_KEY = "noderuntime.client"  # the ASGI scope's entry naming the authenticated key


def key_identity(key: bytes) -> str:
    """A short digest naming an API key: the line's bookkeeping holds no secrets."""
    return hashlib.sha256(key).hexdigest()[:16]


def client_identity(scope: Mapping[str, Any]) -> str:
    """Who sent a request, for fair shares: the API key it proved (:class:`ApiKeys` wrote it), or,
    where the gateway has no keys, the address it came from; "" when neither is known."""
    proved = scope.get(CLIENT_KEY)
    if isinstance(proved, str):
        return proved
    peer = scope.get("client")
    return f"address:{peer[0]}" if peer else ""
