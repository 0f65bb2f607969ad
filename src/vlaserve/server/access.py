"""The API key: checking the one a request offers, and short-lived tickets standing in for it in a URL."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

from .schema import ApiError

TICKET_LIFETIME_S = 60.0


class Access:
    """The checks of one server's API key (None: every request is authorized, no ticket is valid)."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """`Authorization: Bearer KEY`, `X-API-Key: KEY`, or openpi-client's `Authorization: Api-Key KEY`."""
        key = self.api_key
        if key is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        offered = [headers.get("x-api-key", "")]
        if scheme.lower() in ("bearer", "api-key"):
            offered.append(token.strip())
        return any(hmac.compare_digest(o.encode(), key.encode()) for o in offered if o)

    def ticket(self, lifetime_s: float = TICKET_LIFETIME_S) -> str:
        """A short-lived proof of a checked API key, for a URL (a client following a redirect to
        another host or port drops its Authorization header)."""
        expires = str(int(time.time() + lifetime_s))
        return f"{expires}.{self._sign(expires)}"

    def valid_ticket(self, ticket: str | None) -> bool:
        if self.api_key is None or not ticket:
            return False
        expires, _, signature = ticket.partition(".")
        return (expires.isdigit() and int(expires) >= time.time()
                and hmac.compare_digest(signature.encode(), self._sign(expires).encode()))

    def _sign(self, text: str) -> str:
        return hmac.new(self.api_key.encode(), b"vlaserve-ticket:" + text.encode(), hashlib.sha256).hexdigest()

    def require_auth(self, headers: Mapping[str, str]) -> None:
        if not self.authorized(headers):
            raise ApiError(401, "unauthorized", "missing or wrong API key "
                                                "(send 'Authorization: Bearer KEY' or 'X-API-Key: KEY')")
