"""The autoscaling policy serve-ray uses with direct websockets: Ray's own policy (ongoing requests
per replica against `target_ongoing_requests`), counting each robot connected straight to a replica
as one more ongoing request, as a robot connected through the proxy already is. Replicas report
their direct robots (`VlaserveReplica.record_autoscaling_stats`); Ray's controller imports this
module by name and calls `count_direct_robots` each control period."""

from __future__ import annotations

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

DIRECT_ROBOTS = "direct_robots"  # the metric each replica reports


class _WithDirectRobots:
    """The controller's AutoscalingContext with the direct robots added to its ongoing requests."""

    def __init__(self, ctx, direct: float):
        self._ctx, self._direct = ctx, direct

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    @property
    def total_num_requests(self) -> float:
        return self._ctx.total_num_requests + self._direct


def count_direct_robots(ctx):
    per_replica = (ctx.aggregated_metrics or {}).get(DIRECT_ROBOTS, {})
    return replica_queue_length_autoscaling_policy(_WithDirectRobots(ctx, float(sum(per_replica.values()))))
