"""The API key: checking the one a request offers, and short-lived tickets standing in for it in a URL; and
the admin routes' key (POST /update_weights_from_disk)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Mapping

from .schema import ApiError

TICKET_LIFETIME_S = 60.0


class Access:
    """The checks of one server's API key (None: every request is authorized, no ticket is valid) and admin key.

    The admin routes take the admin key where one is set (the API key then gets 403), else the API key; with
    neither, they answer only clients on this computer (loopback). The admin key is not an API key: the robot
    routes take it only where it is the same key."""

    def __init__(self, api_key: str | None, admin_key: str | None = None):
        self.api_key, self.admin_key = api_key, admin_key

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """`Authorization: Bearer KEY`, `X-API-Key: KEY`, or openpi-client's `Authorization: Api-Key KEY`."""
        return self.api_key is None or _offers(headers, self.api_key)

    def require_admin(self, headers: Mapping[str, str], client_host: str | None) -> None:
        """An admin route's check (see the class): 401 without the key it needs, 403 for the API key where an
        admin key is set, or for a client on another computer where no key is set."""
        if self.admin_key is not None:
            if _offers(headers, self.admin_key):
                return
            if self.api_key is not None and _offers(headers, self.api_key):
                raise ApiError(403, "forbidden", "this route needs the admin key ($VLASERVE_ADMIN_API_KEY or the "
                                                 "config file's admin_api_key_file), not the API key")
            raise ApiError(401, "unauthorized", "missing or wrong admin key (send 'Authorization: Bearer KEY' or "
                                                "'X-API-Key: KEY')")
        if self.api_key is not None:
            self.require_auth(headers)
        elif not _loopback(client_host):
            raise ApiError(403, "forbidden", "a server without an API key or admin key answers this route only on "
                                             "its own computer (loopback); set an admin key to call it from another")

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


def _offers(headers: Mapping[str, str], key: str) -> bool:
    """Whether the request offers `key` (any of the forms `Access.authorized` takes)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    offered = [headers.get("x-api-key", "")]
    if scheme.lower() in ("bearer", "api-key"):
        offered.append(token.strip())
    return any(hmac.compare_digest(o.encode(), key.encode()) for o in offered if o)


def _loopback(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # (::ffff:127.0.0.1 too)
