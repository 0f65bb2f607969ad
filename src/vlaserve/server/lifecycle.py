"""uvicorn, hardened: a header timeout and a connection limit on the HTTP protocol, and a shutdown
that drains websocket sessions before uvicorn closes them.

Why at the protocol: uvicorn (h11) has no timeout until a request's headers are complete, so a client
that opens connections and never finishes its headers holds a file descriptor forever (1,100 of
them exhausted a 1,024-fd limit; every later accept() failed). And its `limit_concurrency` answers
plain text. Here a connection past `max_connections` gets one JSON 503 and is closed, and one that
has no complete request within `header_timeout_s` (from its opening, or from its last response) is
closed.
"""

from __future__ import annotations

import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .guard import error_body
from .sessions import Sessions

log = logging.getLogger(__name__)


def _canned_503() -> bytes:
    body = error_body(503, "too_many_connections", "the server has too many open connections; retry shortly")
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def guarded_http_protocol(header_timeout_s: float, max_connections: int) -> type:
    refusal = _canned_503()

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._refused = len(self.connections) > max_connections
            if self._refused:
                log.warning("refused a connection: %d open (--max-connections %d)", len(self.connections) - 1,
                            max_connections)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._refused:  # answer once the request has started arriving, so the client reads it
                if not self.transport.is_closing():
                    self.transport.write(refusal)
                    self.transport.close()
                return
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc):
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            waiting_for_request = self.cycle is None or self.cycle.response_complete
            upgraded = self.transport.get_protocol() is not self  # now a websocket: not ours to time
            if waiting_for_request and not upgraded and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, sessions: Sessions, drain_timeout_s: float):
        super().__init__(config)
        self.sessions = sessions
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting first; uvicorn's shutdown closes them again (a no-op)
            server.close()
        await self.sessions.drain(self.drain_timeout_s)
        await super().shutdown(sockets)
