"""The asyncio client: the same calls as `Client`, awaited."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from .protocol import (RETRYABLE, refused_key, retry_delay, AuthenticationError, ConnectionLost, ConnectionSettings, Reply, ServerError, auth_headers,
                       backoff_delays, parse_metadata, protocol_named, websocket_url)

log = logging.getLogger(__name__)


class AsyncClient:
    """`Client` for asyncio programs: `await client.metadata()`, `await client.infer(obs)`.
    Not for concurrent calls on one instance: requests on one socket are answered in order, so
    a second caller would wait anyway; open one client per concurrent stream."""

    def __init__(self, url: str = "ws://127.0.0.1:8000", **settings):
        self.settings = ConnectionSettings(url=url, **settings)
        self.protocol = protocol_named(self.settings.protocol)
        self.url = websocket_url(url, self.protocol)
        self.connects = 0
        self._ws: ClientConnection | None = None
        self._metadata: dict | None = None

    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def connect(self) -> dict:
        if self._ws is not None:
            return self._metadata
        s = self.settings
        deadline = time.monotonic() + s.reconnect_timeout
        for delay in backoff_delays(s.backoff_initial, s.backoff_max):
            try:
                return await self._open()
            except AuthenticationError:
                raise
            except (*RETRYABLE, WebSocketException) as e:
                await asyncio.sleep(retry_delay(e, delay, deadline, self.url, s.reconnect_timeout))

    async def _open(self) -> dict:
        s = self.settings
        try:
            ws = await connect(self.url, additional_headers=auth_headers(s.api_key), open_timeout=s.connect_timeout,
                               close_timeout=s.close_timeout, max_size=s.max_frame_bytes, compression=None)
        except InvalidStatus as e:
            raise refused_key(e, self.url) from None
        try:
            self._metadata = parse_metadata(await asyncio.wait_for(ws.recv(), s.connect_timeout))
        except BaseException:
            await ws.close()
            raise
        self._ws = ws
        self.connects += 1
        return self._metadata

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def metadata(self) -> dict:
        return await self.connect()

    async def infer(self, observation: Mapping, *, rtc: Mapping | None = None, seed: int | None = None,
                    num_inference_steps: int | None = None, return_noise: bool = False,
                    return_trace: bool = False) -> Reply:
        """See `Client.infer`."""
        frame = self.protocol.encode(observation, rtc, seed, num_inference_steps, return_noise, return_trace)
        await self.connect()
        ws = self._ws
        started = time.perf_counter()
        try:
            await ws.send(frame)
            answer = await asyncio.wait_for(ws.recv(), self.settings.timeout)
        except TimeoutError:
            await self.close()
            raise TimeoutError(f"no reply from {self.url} within {self.settings.timeout:g} s "
                               "(connection closed; the next call reconnects)") from None
        except (ConnectionClosed, OSError) as e:
            self._ws = None
            raise ConnectionLost(f"connection to {self.url} lost during a request: {e}") from e
        round_trip_ms = (time.perf_counter() - started) * 1000.0
        try:
            outputs, timing = self.protocol.decode(answer)
        except ServerError:
            if self.protocol.name == "openpi":
                await self.close()
            raise
        return Reply(round_trip_ms=round_trip_ms, server_timing=timing, **outputs)
