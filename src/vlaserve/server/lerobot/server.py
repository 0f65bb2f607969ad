"""LeRobot's `AsyncInference` gRPC service (`vlaserve serve --lerobot-port PORT`), on the server's
event loop: its observations become the same Requests as every other route's and batch with them.

Every error is a gRPC status whose details name what was wrong (or refused); a robot's error never
touches another robot's session.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ..schema import ApiError
from ..service import Service
from . import pickles, replies, wire
from .records import RemotePolicyConfig, TimedObservation
from .robots import RobotSessions, SetupError, check_setup, served_names

log = logging.getLogger(__name__)

ROUTE = "lerobot"
OBSERVATION_WAIT_S = 2.0  # GetActions answers Empty when no observation came meanwhile (LeRobot's default)
ACTION_DT_S = 1 / 30  # spacing of the actions' timestamps: LeRobot's policy server at its default 30 fps
MAX_MESSAGE_BYTES = 4 * 2**20 + 2**16  # one gRPC message: LeRobot sends 2 MiB chunks, its channels take 4 MiB
MAX_SETUP_BYTES = 2**20
MAX_CHUNKS = 1024  # messages in one observation's stream
MAX_SESSIONS = 256
STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 422: grpc.StatusCode.INVALID_ARGUMENT,
          500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}


class AsyncInference:
    def __init__(self, service: Service, checkpoint_arg: str | None):
        self.service = service
        self.sessions = RobotSessions(MAX_SESSIONS)
        self.names = served_names(service.policy.metadata, checkpoint_arg)
        self.metadata = {k: service.policy.metadata[k] for k in ("model", "policy_type")}

    # ---- the four methods -----------------------------------------------------------------
    async def Ready(self, request, context):  # noqa: N802 - the wire's name
        self.sessions.reset(context.peer())
        log.info("lerobot robot %s ready", context.peer())
        return wire.Empty()

    async def SendPolicyInstructions(self, request, context):  # noqa: N802
        if len(request.data) > MAX_SETUP_BYTES:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the policy setup is {len(request.data)} bytes; at most {MAX_SETUP_BYTES}")
        config = await self._unpickle(request.data, RemotePolicyConfig, context)
        try:
            features = check_setup(config, self.metadata, self.names, self.service.layout)
        except SetupError as e:
            await self._abort(context, getattr(grpc.StatusCode, e.status), str(e))
        session = self.sessions.get(context.peer()) or self.sessions.reset(context.peer())
        session.config, session.features = config, features
        log.info("lerobot robot %s: %s, %d actions per chunk, features %s", context.peer(),
                 config.pretrained_name_or_path, config.actions_per_chunk, ", ".join(features))
        return wire.Empty()

    async def SendObservations(self, request_iterator, context):  # noqa: N802
        data = await self._receive(request_iterator, context)
        session = await self._session(context)
        if session.config is None:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                              "send the policy instructions first (RobotClient.start does)")
        observation = await self._unpickle(data, TimedObservation, context)
        try:
            state = session.state_of(observation.observation)
            request = session.request(observation, self.service)
        except ApiError as e:
            await self._fail(context, e)
        session.offer(observation, request, state)
        return wire.Empty()

    async def GetActions(self, request, context):  # noqa: N802
        session = await self._session(context)
        taken = await session.take(OBSERVATION_WAIT_S)
        if taken is None:
            return wire.Empty()  # LeRobot's client reads an empty message as "nothing yet" and asks again
        observation, inference = taken
        started = time.perf_counter()
        try:
            result = await self.service.infer(inference, in_request_body=False)
        except ApiError as e:
            await self._fail(context, e)
        actions = result.actions[:session.config.actions_per_chunk]
        data = replies.timed_actions(actions, observation.timestamp, observation.timestep, ACTION_DT_S)
        metrics = self.service.metrics
        metrics.requests.labels(ROUTE, "200").inc()
        metrics.latency.labels(ROUTE).observe(time.perf_counter() - started)
        return wire.Actions(data=data)

    # ---- shared steps -----------------------------------------------------------------------
    async def _session(self, context):
        session = self.sessions.get(context.peer())
        if session is None:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                              "call Ready and send the policy instructions first (RobotClient.start does)")
        return session

    async def _receive(self, request_iterator, context) -> bytes:
        """One observation's bytes: BEGIN (restarts), MIDDLE..., END; bounded in bytes, messages and time."""
        limit = self.service.settings.max_payload_bytes
        buffer, count = bytearray(), 0
        try:
            async with asyncio.timeout(self.service.settings.body_timeout_s):
                async for message in request_iterator:
                    count += 1
                    if count > MAX_CHUNKS:
                        await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          f"an observation of more than {MAX_CHUNKS} messages")
                    state = message.transfer_state
                    if state == wire.TRANSFER_BEGIN:
                        buffer.clear()
                    elif state not in (wire.TRANSFER_MIDDLE, wire.TRANSFER_END):
                        await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                          f"transfer_state {state}: expected BEGIN, MIDDLE or END")
                    if len(buffer) + len(message.data) > limit:
                        await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          f"an observation of more than {limit} bytes (--max-payload-mb)")
                    buffer += message.data
                    if state == wire.TRANSFER_END:
                        return bytes(buffer)
        except TimeoutError:
            await self._abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"the observation did not end within {self.service.settings.body_timeout_s:g} s "
                              "(--body-timeout-s)")
        await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the stream ended before TRANSFER_END")

    async def _unpickle(self, data: bytes, kind: type, context):
        try:
            value = await self.service.workers.in_thread(pickles.loads, data)
        except pickles.Refused as e:
            log.warning("lerobot robot %s: refused %s", context.peer(), e)
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"refused: {e}")
        except ApiError as e:  # the workers' backlog is full
            await self._fail(context, e)
        if not isinstance(value, kind):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                              f"expected a pickled {kind.__name__}, got {type(value).__name__}")
        return value

    async def _fail(self, context, error: ApiError):
        self.service.metrics.errors.labels(ROUTE, error.type).inc()
        code = STATUS.get(error.status, grpc.StatusCode.UNKNOWN)
        await self._abort(context, code, f"{error.type}: {error.field + ': ' if error.field else ''}{error.message}")

    async def _abort(self, context, code, details: str):
        self.service.metrics.requests.labels(ROUTE, code.name).inc()
        await context.abort(code, details)


def _handlers(servicer: AsyncInference) -> grpc.GenericRpcHandler:
    empty = wire.Empty.FromString, wire.Empty.SerializeToString
    return grpc.method_handlers_generic_handler(wire.SERVICE, {
        "SendObservations": grpc.stream_unary_rpc_method_handler(
            servicer.SendObservations, wire.Observation.FromString, empty[1]),
        "GetActions": grpc.unary_unary_rpc_method_handler(
            servicer.GetActions, empty[0], wire.Actions.SerializeToString),
        "SendPolicyInstructions": grpc.unary_unary_rpc_method_handler(
            servicer.SendPolicyInstructions, wire.PolicySetup.FromString, empty[1]),
        "Ready": grpc.unary_unary_rpc_method_handler(servicer.Ready, *empty),
    })


class LeRobotGateway:
    """ASGI wrapper: starts the gRPC server once the app has started (its batcher runs) and stops it,
    letting running calls finish, before the app stops."""

    def __init__(self, app, service: Service, host: str, port: int, checkpoint_arg: str | None,
                 max_connections: int, drain_timeout_s: float):
        self.app, self.service, self.address = app, service, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.checkpoint_arg, self.max_rpcs, self.drain_timeout_s = checkpoint_arg, max_connections, drain_timeout_s
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server(
            maximum_concurrent_rpcs=self.max_rpcs,
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self.server.add_generic_rpc_handlers((_handlers(AsyncInference(self.service, self.checkpoint_arg)),))
        self.server.add_insecure_port(self.address)
        await self.server.start()
        log.info("serving LeRobot's robot_client (gRPC AsyncInference) at %s", self.address)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(self.drain_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def receive_and_stop():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.stop()
            return message

        async def start_then_send(message):
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self.start()
                except Exception as e:  # noqa: BLE001 - reported as the startup's failure
                    message = {"type": "lifespan.startup.failed", "message": f"--lerobot-port {self.address}: {e}"}
            await send(message)

        await self.app(scope, receive_and_stop, start_then_send)
