"""The blocking client: one websocket, reconnected with backoff, one request at a time."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextlib import ExitStack

from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection, connect

from .protocol import (RETRYABLE, refused_attempt, refused_key, retry_delay, AuthenticationError, BatchError, ConnectionLost, ConnectionSettings, Reply, ServerError, auth_headers,
                       backoff_delays, parse_metadata, post_json, protocol_named, websocket_url)

log = logging.getLogger(__name__)


class Client:
    """A vlaserve server over `/v1/actions/realtime` (default) or the OpenPI socket.

    >>> with Client("ws://gpu-box:8000", api_key=KEY) as client:
    ...     chunk = client.infer({"images": {"base_0_rgb": img}, "state": state, "task": "fold"}).actions

    Connects on first use. A call made while disconnected reconnects (backoff up to
    `reconnect_timeout`); a connection lost mid-request raises ConnectionLost, a late reply
    TimeoutError (and the socket is closed, so that reply cannot be taken for the next one's).
    """

    def __init__(self, url: str = "ws://127.0.0.1:8000", **settings):
        self.settings = ConnectionSettings(url=url, **settings)
        self.protocol = protocol_named(self.settings.protocol)
        self.url = websocket_url(url, self.protocol)
        self.connects = 0  # successful handshakes; > 1 means it reconnected
        self._ws: ClientConnection | None = None
        self._exit = ExitStack()  # the open connection's context (websockets wants connect() as one)
        self._metadata: dict | None = None

    # ---- connection -------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._ws is not None

    def connect(self, *, retry: bool = True) -> dict:
        """Opens the socket and reads the metadata frame, retrying refused or failed attempts with
        exponential backoff for up to `reconnect_timeout` seconds. Returns the metadata.
        `retry=False`: one attempt, raising ConnectionError when it fails (the caller paces retries)."""
        if self._ws is not None:
            return self._metadata
        s = self.settings
        deadline = time.monotonic() + s.reconnect_timeout
        for delay in backoff_delays(s.backoff_initial, s.backoff_max):
            try:
                return self._open()
            except AuthenticationError:
                raise
            except (*RETRYABLE, WebSocketException) as e:
                if not retry:
                    raise refused_attempt(e, self.url) from e
                time.sleep(retry_delay(e, delay, deadline, self.url, s.reconnect_timeout))

    def _open(self) -> dict:
        s = self.settings
        stack = ExitStack()
        try:
            ws = stack.enter_context(connect(self.url, additional_headers=auth_headers(s.api_key),
                                             open_timeout=s.connect_timeout, close_timeout=s.close_timeout,
                                             max_size=s.max_frame_bytes, compression=None))
        except InvalidStatus as e:
            raise refused_key(e, self.url) from None
        with stack:  # closes the socket if the metadata frame does not come
            self._metadata = parse_metadata(ws.recv(timeout=s.connect_timeout))
            self._ws, self._exit = ws, stack.pop_all()
        self.connects += 1
        return self._metadata

    def close(self) -> None:
        self._ws = None
        self._exit.close()

    # ---- the trainer's side --------------------------------------------------------------------------
    def update_weights(self, model_path: str, *, admin_key: str | None = None, timeout: float = 600.0) -> dict:
        """POST /update_weights_from_disk over HTTP (no socket needed): the server loads the checkpoint at
        `model_path` (a path on the server's computer) into its served weights in place, between batches ->
        its reply ({"success", "message", "weight_version", "load_ms", ...}). A refused update (nothing
        changed) raises ServerError: its type says why (checkpoint_not_found, checkpoint_mismatch,
        invalid_checkpoint, update_in_progress, update_unavailable, forbidden). `admin_key`: the server's admin
        key, where it has one (default: this client's api_key)."""
        return post_json(self.settings.url, "/update_weights_from_disk", {"model_path": str(model_path)},
                         admin_key or self.settings.api_key, timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- calls --------------------------------------------------------------------------------------
    def metadata(self) -> dict:
        """The server's metadata (action_horizon, action_dim, cameras, …), from the latest connect."""
        return self.connect()

    def infer(self, observation: Mapping, *, rtc: Mapping | None = None, seed: int | None = None,
              num_inference_steps: int | None = None, reconnect: bool = True, return_noise: bool = False,
              return_trace: bool = False) -> Reply:
        """One action chunk for `observation` ({"images": {camera: HxWx3}, "state": [...], "task": str}).
        `rtc`: {"prev_chunk": [T, action_dim], "space": "action", "inference_delay", "execution_horizon", …}.
        `reconnect=False`: raise ConnectionLost instead of reconnecting first when disconnected (the
        observation would be old by the time a reconnect ends). `return_noise` / `return_trace`: the
        Reply's `noise` / `trace` (realtime protocol). Raises ServerError (naming the field) when the
        server refuses the request."""
        frame = self.protocol.encode(observation, rtc, seed, num_inference_steps, return_noise, return_trace)
        answer, round_trip_ms = self._round_trip(frame, reconnect)
        try:
            outputs, timing = self.protocol.decode(answer)
        except ServerError:
            if self.protocol.name == "openpi":  # the server closes the socket after an error
                self.close()
            raise
        return Reply(round_trip_ms=round_trip_ms, server_timing=timing, **outputs)

    def infer_batch(self, observations: list[Mapping], *, seed: int | None = None, seeds: list[int] | None = None,
                    num_inference_steps: int | None = None, return_noise: bool = False,
                    return_trace: bool = False) -> list[Reply]:
        """One action chunk per observation, from one request (the server splits a batch larger than its
        batch limit). The observations share keys, cameras and array shapes; each has its own task (and
        noise, if any). `seeds`: one per observation (item i's noise depends on seeds[i] alone); or
        `seed`: item i gets seed + i. Raises BatchError (with the items that succeeded) when some
        observations fail, ServerError when the whole request is refused. Realtime protocol only."""
        if self.protocol.name != "realtime":
            raise ValueError("infer_batch needs protocol='realtime' (the OpenPI protocol sends one observation a frame)")
        if seeds is not None:
            if seed is not None:
                raise ValueError("give seed (item i gets seed + i) or seeds (one per observation), not both")
            seed = [int(s) for s in seeds]
        frame = self.protocol.encode_batch(observations, seed, num_inference_steps, return_noise, return_trace)
        answer, round_trip_ms = self._round_trip(frame)
        items, timing = self.protocol.decode_batch(answer)
        replies = [None if isinstance(item, ServerError) else
                   Reply(round_trip_ms=round_trip_ms, server_timing=timing, **item) for item in items]
        errors = [item if isinstance(item, ServerError) else None for item in items]
        if any(errors):
            raise BatchError(replies, errors)
        return replies

    def _round_trip(self, frame: bytes, reconnect: bool = True) -> tuple[object, float]:
        """Sends one frame and waits for its answer: (answer, round trip in ms)."""
        if reconnect:
            self.connect()
        ws = self._ws
        if ws is None:
            raise ConnectionLost(f"not connected to {self.url} (and told not to reconnect)")
        started = time.perf_counter()
        try:
            ws.send(frame)
            answer = ws.recv(timeout=self.settings.timeout)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"no reply from {self.url} within {self.settings.timeout:g} s "
                               "(connection closed; the next call reconnects)") from None
        except (ConnectionClosed, OSError) as e:
            self.close()
            raise ConnectionLost(f"connection to {self.url} lost during a request: {e}") from e
        return answer, (time.perf_counter() - started) * 1000.0
