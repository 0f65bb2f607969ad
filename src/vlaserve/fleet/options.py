"""serve-ray's own options (the Ray keys), on top of every `vlaserve serve` option; stdlib only,
so the CLI can list them without Ray installed."""

from __future__ import annotations

# name -> (type, default, metavar, help), the format of cli.SERVER_OPTIONS.
RAY_OPTIONS: dict[str, tuple[type, object, str, str]] = {
    "replicas": (int, 1, "N", "replicas when not autoscaling (each loads the checkpoint once)"),
    "min_replicas": (int, None, "N", "autoscale: fewest replicas (default 1; needs --max-replicas)"),
    "max_replicas": (int, None, "N", "autoscale between --min-replicas and this many replicas"),
    "target_ongoing_requests": (float, 2.0, "N", "autoscale: ongoing requests per replica to aim for "
                                                 "(an open websocket counts as one for its lifetime)"),
    "max_ongoing_requests": (int, 64, "N", "most ongoing requests (robots + in-flight HTTP) per replica; "
                                            "more wait in the proxy"),
    "downscale_delay_s": (float, 60.0, "S", "autoscale: how long load must stay low before a replica goes"),
    "gpus_per_replica": (float, None, "N", "GPUs Ray reserves per replica (default: 0 with --device cpu, else 1)"),
    "cpus_per_replica": (float, 1.0, "N", "CPUs Ray reserves per replica"),
    "ray_address": (str, None, "ADDR", "an existing Ray cluster (auto, or ray://host:10001); "
                                       "default: start a local one"),
    "robot_id_header": (str, "x-robot-id", "NAME", "HTTP header whose value keeps requests on one replica "
                                                   "(local cluster only; on a running cluster set "
                                                   "RAY_SERVE_SESSION_ID_HEADER_KEY there)"),
    "app_name": (str, "vlaserve", "NAME", "the Ray Serve application name"),
    "direct_websockets": (bool, False, None, "robots' websockets go straight to their replica's own port (a "
                                             "redirect at the handshake): no proxy hop per message; robots must "
                                             "reach the replica hosts (each replica reports them to the autoscaler)"),
}


class RayOptionError(ValueError):
    pass


def check_ray_options(options: dict) -> None:
    """Raises RayOptionError naming the first bad Ray key."""
    for name, (kind, _, _, _) in RAY_OPTIONS.items():
        value = options[name]
        if value is None:
            continue
        if kind is bool:
            if not isinstance(value, bool):
                raise RayOptionError(f"{name} must be true or false")
            continue
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if not ok or isinstance(value, bool):
            raise RayOptionError(f"{name} must be {'an integer' if kind is int else 'a number' if kind is float else 'a string'}")
    if options["replicas"] < 1:
        raise RayOptionError("replicas must be at least 1")
    if options["min_replicas"] is not None and options["max_replicas"] is None:
        raise RayOptionError("min_replicas needs max_replicas (autoscaling runs between the two)")
    if options["max_replicas"] is not None:
        low = 1 if options["min_replicas"] is None else options["min_replicas"]
        if low < 0 or options["max_replicas"] < max(low, 1):
            raise RayOptionError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
    for name in ("target_ongoing_requests", "downscale_delay_s", "cpus_per_replica"):
        if options[name] < 0 or (name == "target_ongoing_requests" and options[name] == 0):
            raise RayOptionError(f"{name} must be positive")
    if options["max_ongoing_requests"] < 1:
        raise RayOptionError("max_ongoing_requests must be at least 1")
    if options["gpus_per_replica"] is not None and options["gpus_per_replica"] < 0:
        raise RayOptionError("gpus_per_replica must not be negative")


def deployment_options(options: dict) -> dict:
    """serve.deployment(...) keyword arguments from the checked options."""
    runtime = options["runtime"]
    gpus = options["gpus_per_replica"]
    if gpus is None:
        gpus = 0 if runtime.device == "cpu" else 1
    out = {
        "ray_actor_options": {"num_cpus": options["cpus_per_replica"], "num_gpus": gpus},
        "max_ongoing_requests": options["max_ongoing_requests"],
        # Ray's own line per request costs the replica's event loop; --log-requests turns it on.
        "logging_config": {"enable_access_log": bool(options["log_requests"])},
        # Drain: Ray waits for in-flight requests (polling every wait-loop period) up to the timeout.
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": options["drain_timeout_s"],
        # A replica answers its first health check only once its graphs are captured (the
        # constructor's blocking warm-up); a big checkpoint on a cold disk takes minutes.
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        # Consistent hashing over the session id Ray reads from the robot-id header: a robot's HTTP
        # requests stay on one replica (its prefix cache and RTC history) while the set of replicas
        # is unchanged; no header: spread evenly.
        "request_router_config": {
            "request_router_class": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
            "request_router_kwargs": {"num_fallback_replicas": 1},
        },
    }
    if options["max_replicas"] is not None:
        out["autoscaling_config"] = {
            "min_replicas": 1 if options["min_replicas"] is None else options["min_replicas"],
            "max_replicas": options["max_replicas"],
            "target_ongoing_requests": options["target_ongoing_requests"],
            "downscale_delay_s": options["downscale_delay_s"],
            "upscale_delay_s": 10.0,
        }
        if options["direct_websockets"]:  # robots on a replica's own port count too (fleet/autoscale.py)
            out["autoscaling_config"]["policy"] = {"policy_function": "vlaserve.fleet.autoscale:count_direct_robots"}
    else:
        out["num_replicas"] = options["replicas"]
    return out
