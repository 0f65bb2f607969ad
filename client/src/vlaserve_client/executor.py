"""Runs action chunks at the control rate while the next chunk is computed: real-time chunking.

Ticks are counted by `get_action` calls: the robot calls it once per control period, and it answers
from memory (a lock held for microseconds, never across network I/O). A worker thread owns the
client. Timeline of one request, with H the chunk length, h `execution_horizon`:

    tick t0: chunk index j, H - j <= h actions left      -> request (observation of t0, remainder chunk[j:])
    ticks t0 .. t0+d'-1: the old chunk keeps running     (d' = ticks until the reply is in)
    tick t0+d': new chunk, index d'                       (its index 0 belongs to tick t0, like prev_chunk[0])

With RTC the server is told `inference_delay` d (our estimate of d') and the remainder, and makes
the new chunk's first d actions equal the ones the robot is executing meanwhile, then blends over
h steps: the switch is smooth as long as d' <= d. If d exceeds what is left of the old chunk, the
prev_chunk sent is padded with the action the robot will hold meanwhile (see on_underrun). Without RTC the same indices are used (the
actions for ticks already past are skipped), but the two chunks need not agree at the switch.

Freshness: an observation is read only on a tick when its request can go out at once (connected,
nothing in flight), and is dropped unsent if the worker could not send it within one control
period. While the server is unreachable no observation is read: the robot runs out its chunk and
holds (on_underrun) while the worker probes the server; the first tick after it is back reads a
fresh one. A reply whose observation is older than `max_staleness_s` when it arrives is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .protocol import ClientError, RtcNotSupported, ServerError, backoff_delays

log = logging.getLogger(__name__)

UNDERRUN_POLICIES = ("repeat", "hold")
CLOSE_WAIT_S = 1.0  # close() waits this long for the worker (longer only inside a connect to a silent host)


class ExecutorError(ClientError):
    """The executor stopped requesting chunks (the server refused a request, or its action shape
    changed); raised by every later `get_action`. The cause is chained."""


@dataclass
class ExecutorStats:
    ticks: int = 0                 # get_action calls
    chunks: int = 0                # chunks received and used, the first included
    requests: int = 0              # requests sent
    rtc_requests: int = 0          # of which carried RTC guidance
    underrun_ticks: int = 0        # ticks with no planned action left (served by the underrun policy)
    late_replies: int = 0          # replies that came after the previous chunk had run out
    stale_dropped: int = 0         # observations too old to act on: unsent past one tick, or replies past max_staleness_s
    delay_underestimates: int = 0  # replies used at a later index than the inference_delay sent
    connection_failures: int = 0   # requests that failed on the network (lost, timed out)
    reconnects: int = 0            # outages ended by a new connection
    outage_ticks: int = 0          # ticks served while disconnected (no request could go out)
    inference_delay: int = 0       # current estimate, in ticks
    last_round_trip_ms: float | None = None
    max_round_trip_ms: float | None = None
    rtc_active: bool = False
    rtc_disabled_reason: str | None = None


@dataclass(frozen=True)
class ExecutorEvent:
    tick: int
    kind: str  # switch, underrun, stale_dropped, connection_failed, reconnected, rtc_disabled
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Outage:
    tick: int     # the tick being served when the connection was found lost
    time: float


@dataclass
class _Request:
    observation: dict
    tick: int
    time: float                   # when the observation was read (the executor's clock)
    remainder: np.ndarray | None  # the planned actions from `tick` on; None once the chunk ran out
    held_action: np.ndarray       # the action served on `tick` (what "repeat" repeats)


class ActionChunkExecutor:
    """Serves one action per control tick from the current chunk and fetches the next in the background.

    >>> executor = ActionChunkExecutor(Client(url), control_hz=50)
    >>> executor.start(read_observation())            # blocks for the first chunk, before the loop
    >>> while running:                                 # at 50 Hz
    ...     robot.apply(executor.get_action(read_observation()))

    Options:
      control_hz          the rate get_action is called at; converts round trips into ticks.
      execution_horizon   request the next chunk when this many planned actions are left (and guide
                          that many steps with RTC). Default: half the chunk. Must exceed the delay
                          in ticks, or every reply is late.
      rtc                 send RTC guidance (falls back to plain switching if the server refuses it).
      on_underrun         "repeat": the last action again; "hold": `hold_action` (e.g. zero velocity).
      delay_margin_ticks  added to the measured delay, for jitter.
      delay_window        the delay is the largest of the last this-many round trips.
      max_staleness_s     a reply whose observation is older than this when it arrives is dropped.
                          Default: the chunk's span (horizon / control_hz).
      max_guidance_weight, schedule, num_inference_steps: passed to the server as given.
      clock               seconds, monotonic (tests inject a fake one).
    """

    def __init__(self, client, *, control_hz: float, execution_horizon: int | None = None, rtc: bool = True,
                 on_underrun: str = "repeat", hold_action=None, delay_margin_ticks: int = 1,
                 delay_window: int = 10, max_staleness_s: float | None = None, max_guidance_weight: float | None = None, schedule: str | None = None,
                 num_inference_steps: int | None = None, max_events: int = 1000,
                 clock: Callable[[], float] = time.monotonic):
        if not control_hz > 0:
            raise ValueError(f"control_hz must be > 0, got {control_hz!r}")
        if on_underrun not in UNDERRUN_POLICIES:
            raise ValueError(f"on_underrun must be one of {UNDERRUN_POLICIES}, got {on_underrun!r}")
        if on_underrun == "hold" and hold_action is None:
            raise ValueError("on_underrun='hold' needs hold_action (the action to send while starved)")
        if delay_margin_ticks < 0 or delay_window < 1:
            raise ValueError("delay_margin_ticks must be >= 0 and delay_window >= 1")
        if max_staleness_s is not None and not max_staleness_s > 0:
            raise ValueError(f"max_staleness_s must be > 0, got {max_staleness_s!r}")
        self.client = client
        self.control_hz = float(control_hz)
        self.on_underrun = on_underrun
        self.delay_margin_ticks = int(delay_margin_ticks)
        self._requested_horizon = execution_horizon
        self._hold_action = None if hold_action is None else np.asarray(hold_action, np.float32)
        self._rtc_options = {k: v for k, v in (("max_guidance_weight", max_guidance_weight),
                                                ("schedule", schedule)) if v is not None}
        self._num_inference_steps = num_inference_steps
        self._want_rtc = rtc
        self._max_staleness_s = max_staleness_s
        self._clock = clock
        self._ages = collections.deque(maxlen=delay_window)  # observation -> chunk available, seconds
        self._first_age: float | None = None
        self._events = collections.deque(maxlen=max_events)

        self._lock = threading.Condition()
        self._stats = ExecutorStats()
        self._chunk: np.ndarray | None = None
        self._chunk_start = 0          # the tick that the current chunk's index 0 belongs to
        self._tick = 0                 # the next tick to serve
        self._last_action: np.ndarray | None = None
        self._in_flight = False        # a request is pending or running; at most one at a time
        self._pending: _Request | None = None
        self._underrun = False
        self._outage: _Outage | None = None  # set while disconnected: no request can go out
        self._error: BaseException | None = None
        self._closed = False
        self._worker: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, observation) -> np.ndarray:
        """Connects, fetches the first chunk (blocking: call it before the control loop) and starts
        the background requests. Returns the first chunk."""
        if self._worker is not None:
            raise RuntimeError("start() was already called")
        metadata = self.client.metadata()
        self.horizon = int(metadata["output"]["action_horizon"])  # SGLang's action.metadata structure
        self.action_dim = int(metadata["output"]["action_dim"])
        h = self._requested_horizon if self._requested_horizon is not None else self.horizon // 2
        if not 1 <= h <= self.horizon:
            raise ValueError(f"execution_horizon must be in 1..{self.horizon} (the chunk length), got {h}")
        self.execution_horizon = int(h)
        if self._max_staleness_s is None:
            self._max_staleness_s = self.horizon / self.control_hz
        if self._hold_action is not None and self._hold_action.shape != (self.action_dim,):
            raise ValueError(f"hold_action must have shape [{self.action_dim}], got {list(self._hold_action.shape)}")
        self._stats.rtc_active = self._want_rtc
        if not self._want_rtc:
            self._stats.rtc_disabled_reason = "rtc=False"
        elif self.client.protocol.name == "openpi":
            self._disable_rtc("the OpenPI protocol carries no RTC guidance")
        elif (metadata.get("features") or {}).get("rtc") is False:
            self._disable_rtc("the server's metadata says features.rtc = false")

        started = self._clock()
        reply = self.client.infer(_snapshot(_read(observation)), num_inference_steps=self._num_inference_steps)
        self._first_age = self._clock() - started
        self._check_shape(reply.actions)
        with self._lock:
            self._chunk, self._chunk_start = reply.actions, 0
            self._stats.chunks = self._stats.requests = 1
            self._stats.inference_delay = self._delay_ticks()
            self._record_round_trip(self._first_age)
        if self._stats.inference_delay >= self.execution_horizon:
            log.warning("the round trip (%.0f ms = %d ticks at %g Hz) is not shorter than execution_horizon=%d: "
                        "expect late chunks; raise execution_horizon", self._first_age * 1e3,
                        self._stats.inference_delay, self.control_hz, self.execution_horizon)
        self._worker = threading.Thread(target=self._run, name="vlaserve-chunk-requests", daemon=True)
        self._worker.start()
        return reply.actions

    def close(self) -> None:
        """Stops the requests: returns within about a second, even with the server gone, and nothing
        is sent after it (a request not yet sent is dropped, one in flight abandoned)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self.client.close()  # wakes a worker blocked on the socket
        if self._worker is not None:
            self._worker.join(timeout=CLOSE_WAIT_S)

    def __enter__(self) -> ActionChunkExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the control-rate call ----------------------------------------------------------------------
    def get_action(self, observation=None) -> np.ndarray:
        """The action for this tick, [action_dim]. Never waits for the network.

        `observation`: the robot's current observation, or a callable returning it (called only on
        ticks that start a request). Needed on those ticks; arrays are copied then, so reusing
        camera buffers is safe."""
        with self._lock:
            if self._error is not None:
                raise ExecutorError(f"chunk requests stopped: {self._error}") from self._error
            if self._chunk is None:
                raise RuntimeError("call start(observation) before get_action")
            tick, index = self._tick, self._tick - self._chunk_start
            request_due = (not self._in_flight and self._outage is None
                           and self.horizon - index <= self.execution_horizon)
            if request_due and observation is None:
                raise ValueError(f"tick {tick} starts a request: pass the observation to get_action")
            self._tick += 1
            self._stats.ticks += 1
            self._stats.outage_ticks += self._outage is not None
            if index < self.horizon:
                action = self._chunk[index]
            else:
                action = self._last_action if self.on_underrun == "repeat" else self._hold_action
                self._stats.underrun_ticks += 1
                if not self._underrun:
                    self._underrun = True
                    self._event(tick, "underrun", in_flight=self._in_flight)
                    log.warning("tick %d: the chunk ran out before the next arrived; %s", tick,
                                "repeating the last action" if self.on_underrun == "repeat" else "holding")
            if request_due:
                remainder = self._chunk[index:] if index < self.horizon else None
                read_at = self._clock()  # before the read: the observation is at least this fresh
                self._pending = _Request(_snapshot(_read(observation)), tick, read_at, remainder, action)
                self._in_flight = True
                self._lock.notify_all()
            self._last_action = action
            return action.copy()

    # ---- what the robot program may read -------------------------------------------------------------
    @property
    def stats(self) -> ExecutorStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    @property
    def events(self) -> list[ExecutorEvent]:
        with self._lock:
            return list(self._events)

    @property
    def error(self) -> BaseException | None:
        """Why chunk requests stopped (then get_action raises ExecutorError), or None."""
        return self._error

    @property
    def rtc_active(self) -> bool:
        return self._stats.rtc_active

    # ---- the worker ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._pending is None and self._outage is None and not self._closed:
                        self._lock.wait()
                    if self._closed:
                        return
                    request, self._pending = self._pending, None
                    delay = self._delay_ticks()
                if self._outage is not None:
                    self._reconnect()
                else:
                    self._fetch(request, delay)
        except BaseException as e:  # a bug or a refusal: stop and let get_action report it
            if not self._closed:
                log.error("chunk requests stopped: %s", e)
                with self._lock:
                    self._error = e
        finally:
            if self._closed:
                self.client.close()  # a connection opened while close() ran

    def _too_old_to_send(self, request: _Request) -> bool:
        """Drops a request about to go out more than one control period after its observation was
        read (the worker was slow to wake, or busy): the next tick reads a fresh one."""
        age = self._clock() - request.time
        if age * self.control_hz <= 1 + 1e-6:
            return False
        self._stats.stale_dropped += 1
        self._event(self._tick, "stale_dropped", stage="unsent", age_ms=round(age * 1e3, 3))
        return True

    def _reconnect(self) -> None:
        """Probes the server (one handshake each, backing off up to the client's backoff_max) until
        it answers or close() is called. Nothing is queued meanwhile."""
        s = self.client.settings
        for delay in backoff_delays(s.backoff_initial, s.backoff_max):
            try:
                self.client.connect(retry=False)
            except ConnectionError:
                with self._lock:
                    if self._lock.wait_for(lambda: self._closed, timeout=delay):
                        return
                continue
            with self._lock:
                outage, self._outage = self._outage, None
                self._in_flight = False
                self._stats.reconnects += 1
                self._event(self._tick, "reconnected", outage_ticks=self._tick - outage.tick,
                            outage_ms=round((self._clock() - outage.time) * 1e3, 3))
            log.warning("reconnected to %s after %.2f s", self.client.url, self._clock() - outage.time)
            return

    def _fetch(self, request: _Request, delay: int) -> None:
        rtc = None
        if self._stats.rtc_active:
            prev = self._expected_execution(request, delay)
            rtc = {"prev_chunk": prev, "space": "action", "inference_delay": min(delay, len(prev)),
                   "execution_horizon": max(self.execution_horizon, len(prev)), **self._rtc_options}
        with self._lock:
            if self._closed or self._too_old_to_send(request):
                self._in_flight = False
                return
            self._stats.requests += 1
            self._stats.rtc_requests += rtc is not None
        try:
            reply = self.client.infer(request.observation, rtc=rtc, num_inference_steps=self._num_inference_steps,
                                      reconnect=False)
        except (ServerError, RtcNotSupported) as e:
            if rtc is None or not _is_rtc_refusal(e):
                raise
            self._disable_rtc(str(e))
            with self._lock:  # the next tick asks again, without guidance, with a fresh observation
                self._in_flight = False
            return
        except (ConnectionError, TimeoutError, OSError) as e:
            if self._closed:
                return
            with self._lock:
                self._stats.connection_failures += 1
                self._event(self._tick, "connection_failed", error=str(e))
                self._outage = _Outage(self._tick, self._clock())
                self._in_flight = False
            log.warning("chunk request failed (%s); holding the chunk while the server is probed", e)
            return
        self._install(request, reply.actions, None if rtc is None else rtc["inference_delay"])

    def _install(self, request: _Request, actions: np.ndarray, delay_sent: int | None) -> None:
        self._check_shape(actions)
        age = self._clock() - request.time
        with self._lock:
            self._record_round_trip(age)
            self._ages.append(age)
            self._stats.inference_delay = self._delay_ticks()
            self._in_flight = False
            index = self._tick - request.tick  # the next tick's index in the new chunk
            if index >= self.horizon or age > self._max_staleness_s:
                self._stats.stale_dropped += 1
                self._event(self._tick, "stale_dropped", stage="reply", age_ms=round(age * 1e3, 3), index=index)
                return
            late = self._underrun
            self._stats.late_replies += late
            self._stats.delay_underestimates += delay_sent is not None and index > delay_sent
            self._stats.chunks += 1
            self._event(self._tick, "switch", index=index, inference_delay=delay_sent, late=late,
                        round_trip_ms=round(age * 1e3, 3))
            self._chunk, self._chunk_start, self._underrun = actions, request.tick, False

    # ---- helpers (callers hold the lock where state is shared) ----------------------------------------
    def _expected_execution(self, request: _Request, delay: int) -> np.ndarray:
        """What the robot will execute from the request's tick on: the remainder, then, if the reply
        is expected after the chunk runs out, the underrun action for the ticks in between. Guiding
        the new chunk toward the held action too makes a late switch as smooth as a timely one."""
        remainder = request.remainder
        if remainder is None:
            remainder = np.zeros((0, self.action_dim), np.float32)
        missing = min(delay, self.horizon) - len(remainder)
        if missing <= 0:
            return remainder
        if self.on_underrun == "hold":
            held = self._hold_action
        else:
            held = remainder[-1] if len(remainder) else request.held_action
        return np.concatenate([remainder, np.repeat(held[None], missing, axis=0)]).astype(np.float32)

    def _delay_ticks(self) -> int:
        age = max(self._ages) if self._ages else self._first_age
        return max(1, math.ceil(age * self.control_hz - 1e-9) + self.delay_margin_ticks)

    def _record_round_trip(self, seconds: float) -> None:
        ms = seconds * 1e3
        self._stats.last_round_trip_ms = ms
        self._stats.max_round_trip_ms = max(ms, self._stats.max_round_trip_ms or 0.0)

    def _disable_rtc(self, reason: str) -> None:
        log.warning("RTC off, plain chunk switching: %s", reason)
        with self._lock:
            self._stats.rtc_active = False
            self._stats.rtc_disabled_reason = reason
            self._event(self._tick, "rtc_disabled", reason=reason)

    def _check_shape(self, actions: np.ndarray) -> None:
        if actions.shape != (self.horizon, self.action_dim):
            raise ExecutorError(f"the server sent actions of shape {list(actions.shape)}, expected "
                                f"[{self.horizon}, {self.action_dim}] (did it restart with another checkpoint?)")

    def _event(self, tick: int, kind: str, **detail) -> None:
        self._events.append(ExecutorEvent(tick, kind, detail))


def _is_rtc_refusal(error: Exception) -> bool:
    """The server has no RTC (or not this form of it): an invalid_request naming an rtc field."""
    if isinstance(error, RtcNotSupported):
        return True
    return error.type == "invalid_request" and (error.field or "").split(".")[0] == "rtc"


def _read(observation):
    return observation() if callable(observation) else observation


def _snapshot(value):
    """A copy of the arrays in an observation: the robot may reuse its buffers after get_action."""
    if isinstance(value, Mapping):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.copy()
    return value
