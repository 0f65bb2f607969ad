"""Prometheus metrics, in a registry of their own (one per app, so tests can run several apps)."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..about import STARTED

STAGES = ("decode", "queue", "preprocess", "prefix", "denoise", "device", "postprocess", "encode")
SERVING_STATES = ("capturing", "ready")  # the runtime serves (batch 1 captured); "warming_up" does not yet
RECENT_WINDOW_S = 60.0  # what /stats (and the page at /) reports: the last minute's inference requests
_RECENT_KEPT = 100_000  # bounds the window's memory at any request rate (1,600 requests a second for a minute)
# From 0.1 ms (msgpack decode) to 30 s (a full-size model on a CPU).
_SECONDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _number(value: float | None) -> float:
    return float("nan") if value is None else value  # None: not yet


class Metrics:
    def __init__(self, max_batch_size: int):
        self.registry = CollectorRegistry()
        self.requests = Counter("vlaserve_requests", "Requests (websocket: messages) by route and status code",
                                ["route", "status"], registry=self.registry)
        self.errors = Counter("vlaserve_errors", "Failed requests by route and error type",
                              ["route", "type"], registry=self.registry)
        self.latency = Histogram("vlaserve_request_seconds", "Time from request received to response encoded",
                                 ["route"], buckets=_SECONDS, registry=self.registry)
        self.stages = Histogram("vlaserve_stage_seconds", "Time per serving stage", ["stage"],
                                buckets=_SECONDS, registry=self.registry)
        self.batch_size = Histogram("vlaserve_batch_size", "Observations per inference batch",
                                    buckets=tuple(range(1, max_batch_size + 1)), registry=self.registry)
        self.in_flight = Gauge("vlaserve_inferences_in_flight", "Observations queued or running",
                               registry=self.registry)
        self.first_action_seconds = Gauge("vlaserve_first_action_seconds",
                                          "Seconds from the start of the process (vlaserve's import) to the first "
                                          "inference result returned; NaN until then", registry=self.registry)
        self.first_action_seconds.set(float("nan"))
        self.weight_updates = Counter("vlaserve_weight_updates", "Weight updates in place (POST "
                                      "/update_weights_from_disk) that succeeded", registry=self.registry)
        self._first_action_unset = True
        self.recent = RecentRequests()

    def request_done(self, route: str, status: int, seconds: float | None, connection=None) -> None:
        """One answered request (a websocket's: one message), counted and timed (`seconds` None: not timed);
        `connection`, given for an inference request only, puts it in the last minute's figures (/stats)."""
        self.requests.labels(route, str(status)).inc()
        if seconds is not None:
            self.latency.labels(route).observe(seconds)
        if connection is not None:
            self.recent.add(status, seconds, connection)

    def watch_runtime(self, stats) -> None:
        """Gauges read from the runtime at each scrape: graphs captured (flat after ready) and calls that
        ran without a graph because their shape was not captured (another step count)."""
        for key, text in (("graph_captures", "CUDA graphs captured (all at startup; flat once ready)"),
                          ("uncaptured_calls", "Calls served without a CUDA graph (shape not captured at startup)"),
                          ("padded_calls", "Batches run padded to a captured size (--graph-batches ladder, or while "
                                           "graphs are still being captured)"),
                          ("split_calls", "Batches run split into captured sizes while graphs are still being captured"),
                          ("request_path_captures", "CUDA graphs captured on a request's path (always 0: captures run "
                                                    "in the warm-up only)"),
                          ("graph_bytes", "Device bytes the fast path's static buffers and graphs took at startup")):
            gauge = Gauge(f"vlaserve_{key}", text, registry=self.registry)
            gauge.set_function(lambda key=key: stats()[key])
        ready = Gauge("vlaserve_ready", "1 once the server serves (/healthz 200: the batch-1 CUDA graphs captured; "
                      "the rest may still be capturing)", registry=self.registry)
        ready.set_function(lambda: float(stats()["state"] in SERVING_STATES))
        for name, key, text in (
                ("graphs_captured", "captured", "CUDA graphs captured so far"),
                ("graphs_total", "total", "CUDA graphs to capture in all (0: no fast path)"),
                ("serving_after_seconds", "serving_after_s", "Warm-up seconds until the server could serve "
                                                             "(batch-1 graphs captured); NaN until then"),
                ("all_graphs_captured_after_seconds", "all_captured_after_s",
                 "Warm-up seconds until every CUDA graph was captured; NaN until then")):
            gauge = Gauge(f"vlaserve_{name}", text, registry=self.registry)
            gauge.set_function(lambda key=key: _number(stats()["graphs"][key]))

    def first_action(self) -> None:
        """Sets vlaserve_first_action_seconds, once: the first inference result returned."""
        if self._first_action_unset:
            self._first_action_unset = False
            self.first_action_seconds.set(time.perf_counter() - STARTED)

    def record_precision(self, report: dict) -> None:
        """The fp8 gate's figures, set once at startup (nothing for the exact bf16 path)."""
        if report.get("precision", "bf16") == "bf16":
            return
        for key, text in (("mean_cosine", "fp8 gate: mean per-sample cosine of fp8's actions to the serving dtype's"),
                          ("worst_cosine", "fp8 gate: worst per-sample cosine"),
                          ("gripper_sign_flips", "fp8 gate: sign disagreements on the gripper dimensions"),
                          ("passed", "fp8 gate: 1 when every figure met its threshold")):
            Gauge(f"vlaserve_fp8_gate_{key}", text, registry=self.registry).set(float(report[key]))

    def observe_stages(self, timings_ms: dict[str, float]) -> None:
        for stage in STAGES:
            if f"{stage}_ms" in timings_ms:
                self.stages.labels(stage).observe(timings_ms[f"{stage}_ms"] / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RecentRequests:
    """The inference requests answered in the last RECENT_WINDOW_S: their status, latency and connection
    (what "robots connected" counts). Used on the event loop only."""

    def __init__(self, window_s: float = RECENT_WINDOW_S, max_kept: int = _RECENT_KEPT):
        self.window_s = window_s
        self._answered: deque[tuple[float, int, float | None, object]] = deque(maxlen=max_kept)

    def add(self, status: int, seconds: float | None, connection) -> None:
        self._answered.append((time.monotonic(), status, seconds, connection))

    def summary(self) -> dict:
        """Requests and errors (4xx/5xx) in the window, the successful ones' latency percentiles in ms
        (None before any), and how many connections sent them."""
        horizon = time.monotonic() - self.window_s
        while self._answered and self._answered[0][0] < horizon:
            self._answered.popleft()
        answered = list(self._answered)
        ok = [seconds for _, status, seconds, _ in answered if status < 400 and seconds is not None]
        p50, p99 = np.percentile(ok, [50, 99]) * 1000.0 if ok else (None, None)
        return {"window_s": self.window_s, "requests": len(answered),
                "errors": sum(status >= 400 for _, status, _, _ in answered),
                "latency_ms": None if p50 is None else {"p50": float(p50), "p99": float(p99)},
                "connections": len({connection for _, _, _, connection in answered})}
