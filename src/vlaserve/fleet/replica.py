"""The Ray Serve deployment: one replica = one Policy (one GPU, or CPU) behind the same FastAPI app
as `vlaserve serve` (server.app.create_app), so routes, errors and metrics are the same."""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from ..options import build_service
from .labels import ReplicaLabels

log = logging.getLogger("vlaserve.fleet")


def shutdown_started() -> bool:
    """Whether Ray Serve has begun this replica's graceful shutdown. Ray offers the user code no hook
    at that moment (only __del__, after the drain), so this reads the replica actor's own flag, and
    says False if a Ray version lays it out differently (then websocket sessions are only closed
    when Ray's drain timeout ends)."""
    try:
        from ray._private.worker import global_worker

        return any(getattr(getattr(actor, "_replica_impl", None), "_shutting_down", False)
                   for actor in global_worker.actors.values())
    except Exception:  # noqa: BLE001 - private layout; absence only weakens the drain
        return False


def load_until_serving(options: dict):
    """-> (Policy, ServerSettings) once the policy serves. Ready means serving: the replica's constructor
    returns (and Ray routes to it) once every CUDA graph is captured (`warmup` blocking, the default),
    or with `warmup: background` once the batch-1 graphs are (the rest captured while it serves)."""
    policy, settings = build_service(options, progress=False)
    wait_until_serving(policy.runtime)
    return policy, settings


def wait_until_serving(runtime, poll_s: float = 0.1) -> None:
    """Blocks until the runtime serves (state "capturing" or "ready"), or its warm-up has ended
    otherwise (state no longer "warming_up"). `runtime.serving` (a threading.Event) wakes it at once."""
    serving = getattr(runtime, "serving", None)  # runtimes without the event: the state alone, polled
    while runtime.state == "warming_up" and not (serving is not None and serving.is_set()):
        if serving is not None:
            serving.wait(poll_s)
        else:
            time.sleep(poll_s)


@serve.deployment
@serve.ingress()
class VlaserveReplica:
    async def __init__(self, options: dict, direct_websockets: bool = False):
        logging.getLogger("vlaserve").setLevel(logging.INFO)
        self.policy, self.settings = await asyncio.to_thread(load_until_serving, options)
        self.drain_timeout_s = options["drain_timeout_s"]
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.service = None
        self._drain_watch = None
        self.direct = None
        self._direct_websockets = direct_websockets
        graphs = self.policy.runtime.stats()["graphs"]
        log.info("replica %s serving: %s on %s (%d of %d CUDA graphs captured, the rest in the background)",
                 self.replica, self.policy.name, self.policy.metadata["device"], graphs["captured"], graphs["total"])

    def __serve_build_asgi_app__(self):
        from ..server import create_app

        app = create_app(self.policy, self.settings)
        self.service = app.state.service
        # Ray's proxy hands a request to one replica: the fleet would serve two versions at once.
        self.service.weight_updates_refused = ("serve-ray updates no replica's weights on its own (this request "
                                               "would reach one replica of the fleet): deploy the new checkpoint "
                                               "as a new application (docs/ray.md)")
        loop = asyncio.get_running_loop()
        self._drain_watch = loop.create_task(self._drain_sessions_on_shutdown())
        labelled = ReplicaLabels(app, self.replica)
        if self._direct_websockets:
            import ray

            from .direct import DirectServer

            # Until it listens, handshakes are accepted through the proxy (redirect() says None).
            self.direct = DirectServer(labelled, ray.util.get_node_ip_address(),
                                       max_message_bytes=self.settings.max_payload_bytes)
            self.service.websocket_redirect = self.direct.redirect
            loop.create_task(self.direct.start())
        return labelled

    async def _drain_sessions_on_shutdown(self) -> None:
        """Ray counts an open websocket as an ongoing request until it closes, so a robot idling on
        its socket would hold a draining replica until the timeout. When the shutdown starts, close
        idle sessions with 1012 (the robot reconnects, to another replica) and let a session that is
        mid-request send its answer first: the same drain as `vlaserve serve`."""
        while not shutdown_started():
            await asyncio.sleep(0.2)
        log.info("replica %s draining its websocket sessions", self.replica)
        await self.service.sessions.drain(self.drain_timeout_s)

    async def record_autoscaling_stats(self) -> dict:
        """For the autoscaler (fleet/autoscale.py): robots connected straight to this replica, which
        Ray's proxy does not see."""
        from .autoscale import DIRECT_ROBOTS

        return {DIRECT_ROBOTS: float(self.direct.robots if self.direct is not None else 0)}

    def check_health(self) -> None:
        """Ray restarts a replica whose check raises: a batcher that died takes the replica with it."""
        batcher = self.service.batcher if self.service is not None else None
        if batcher is not None and not batcher.alive:  # the threads every request waits on
            raise RuntimeError("the inference threads have stopped")

    async def __del__(self):
        if self._drain_watch is not None:
            self._drain_watch.cancel()
        if self.direct is not None:  # its sessions were drained with the rest
            await self.direct.stop()


def build(options: dict, name: str | None = None):
    """The bound application for serve.run (options: options.serve_options with the Ray keys)."""
    from .options import RAY_OPTIONS, deployment_options

    # The replicas get only serve's options: a change of a Ray key (scale, autoscaling) then leaves
    # their constructor arguments equal, so Ray scales in place instead of replacing every replica.
    serve_options = {k: v for k, v in options.items() if k not in RAY_OPTIONS}
    return VlaserveReplica.options(name=name or "VlaserveReplica", **deployment_options(options)).bind(
        serve_options, direct_websockets=bool(options.get("direct_websockets")))
