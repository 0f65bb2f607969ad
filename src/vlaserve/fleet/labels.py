"""The replica's ASGI wrapper: its id on every HTTP response and on every /metrics sample.

Through the Ray proxy a scrape of /metrics reaches one replica; the `replica` label (and the
`x-vlaserve-replica` response header) says which, so samples from different replicas never merge."""

from __future__ import annotations

REPLICA_HEADER = b"x-vlaserve-replica"


def label_samples(exposition: bytes, replica: str) -> bytes:
    """Prometheus text format with `replica="..."` added as the first label of every sample."""
    label = f'replica="{replica}"'
    out = []
    for line in exposition.decode().splitlines():
        if line and not line.startswith("#"):
            cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
            name, rest = line[:cut], line[cut:].removeprefix("{}")
            line = f"{name}{{{label},{rest[1:]}" if rest.startswith("{") else f"{name}{{{label}}}{rest}"
        out.append(line)
    return ("\n".join(out) + "\n").encode()


class ReplicaLabels:
    """ASGI middleware around the vlaserve app (server.app.create_app)."""

    def __init__(self, app, replica: str):
        self.app = app
        self.replica = replica

    def add_exception_handler(self, *args, **kwargs):
        # Ray Serve registers its backpressure handlers on the ingress app when it has this method.
        return self.app.add_exception_handler(*args, **kwargs)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics = scope.get("path") == "/metrics"
        held: list[dict] = []

        async def send_labelled(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if not (metrics and k.lower() == b"content-length")]
                message = {**message, "headers": [*headers, (REPLICA_HEADER, self.replica.encode())]}
                if metrics:  # the body's length changes: send the head with the (whole) body
                    held.append(message)
                    return
            elif metrics and message["type"] == "http.response.body":
                held.append(message)
                if message.get("more_body"):
                    return
                head, *bodies = held
                body = label_samples(b"".join(m.get("body", b"") for m in bodies), self.replica)
                await send({**head, "headers": [*head["headers"], (b"content-length", str(len(body)).encode())]})
                message = {"type": "http.response.body", "body": body}
            await send(message)

        await self.app(scope, receive, send_labelled)
