"""A `serve run` / KubeRay RayService target: `serve run vlaserve.fleet.target:app config=fleet.json`
(the config file of `vlaserve serve-ray`; its host, port, ray_address and robot_id_header are the
cluster's business there)."""

from __future__ import annotations

from ..options import UsageError
from .command import fleet_options


def app(args: dict):
    from .replica import build  # imports Ray

    cli = {"config": args["config"]} if "config" in args else {}
    try:
        options = fleet_options(cli)
    except UsageError as e:
        raise ValueError(str(e)) from None
    return build(options)
