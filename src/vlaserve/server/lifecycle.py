"""uvicorn, hardened: a header timeout and a connection limit on the HTTP protocol, and a shutdown
that drains websocket sessions before uvicorn closes them.

Why at the protocol: uvicorn (h11) has no timeout until a request's headers are complete, so a client
that opens connections and never finishes its headers holds a file descriptor forever (1,100 of
them exhausted a 1,024-fd limit; every later accept() failed). And its `limit_concurrency` answers
plain text. Here a connection past `max_connections` gets one JSON 503 and is closed, and one that
has no complete request within `header_timeout_s` (from its opening, or from its last response) is
closed.

Past `max_connections`, a new connection first sheds the oldest idle one (waiting for its first
request or its next one: parked half-headers go first), so parked connections can't starve a normal
client; only when none is idle is the new one refused. `connection_limit` (cli) keeps the limit
below the open-file limit, a reserve of descriptors to accept and then shed with.

A response sent while its client is still uploading the body (a 413 from the declared length, or
from the bytes streamed so far) would be lost to a reset if the connection closed under the upload:
the rest of the body is read and discarded instead, up to DRAIN_FACTOR times the payload limit and
the body timeout, so the client finishes sending and reads its answer.
"""

from __future__ import annotations

import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .bodies import DRAIN_FACTOR
from .guard import error_body
from .sessions import Sessions

log = logging.getLogger(__name__)


def _canned_503() -> bytes:
    body = error_body(503, "too_many_connections", "the server has too many open connections; retry shortly")
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def guarded_http_protocol(header_timeout_s: float, max_connections: int, max_payload_bytes: int = 64 * 2**20,
                          body_timeout_s: float = 60.0) -> type:
    refusal = _canned_503()
    drain_bytes = DRAIN_FACTOR * max_payload_bytes

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._idle_since = self.loop.time()
            self._drain_left: int | None = None  # bytes of an answered body still to discard, while draining
            self._refused = self._open_connections() > max_connections and not self._shed_oldest_idle()
            if self._refused:
                log.warning("refused a connection: %d open, none idle (--max-connections %d)",
                            self._open_connections() - 1, max_connections)
            self._arm_timer(header_timeout_s, self._header_timeout)

        def _open_connections(self) -> int:
            return sum(1 for c in self.connections if not c.transport.is_closing())

        def _idle(self) -> bool:
            """Waiting for a request (its first, or its next): nothing of it would be lost if closed."""
            return (self._drain_left is None and (self.cycle is None or self.cycle.response_complete)
                    and self.transport.get_protocol() is self and not self.transport.is_closing())

        def _shed_oldest_idle(self) -> bool:
            idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c is not self and c._idle()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._idle_since)
            oldest.transport.close()
            return True

        def data_received(self, data: bytes) -> None:
            if self._refused:  # answer once the request has started arriving, so the client reads it
                if not self.transport.is_closing():
                    self.transport.write(refusal)
                    self.transport.close()
                return
            if self._drain_left is not None:
                self._drain_left -= len(data)
                if self._drain_left < 0:
                    self.transport.close()
                    return
            super().data_received(data)
            if self._drain_left is not None and self.conn.their_state is not h11.SEND_BODY:
                self._drain_left = None  # the answered body is all in: an idle keep-alive connection again
                self._idle_since = self.loop.time()
                self._arm_timer(header_timeout_s, self._header_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._idle_since = self.loop.time()
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self._drain_left = drain_bytes
                self._arm_timer(body_timeout_s, self._drain_timeout)
            else:
                self._arm_timer(header_timeout_s, self._header_timeout)

        def connection_lost(self, exc):
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm_timer(self, seconds: float, callback) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(seconds, callback)

        def _header_timeout(self) -> None:
            self._timer = None
            waiting_for_request = self.cycle is None or self.cycle.response_complete
            upgraded = self.transport.get_protocol() is not self  # now a websocket: not ours to time
            if waiting_for_request and not upgraded and not self.transport.is_closing():
                self.transport.close()

        def _drain_timeout(self) -> None:
            self._timer = None
            if self._drain_left is not None and not self.transport.is_closing():
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
